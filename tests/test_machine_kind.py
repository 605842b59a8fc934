"""environment.machine_kind names the results/ folder a run goes to: the GPU's model where one runs, else the
CPU family its figures depend on (results/README.md lists the kinds)."""

from __future__ import annotations

import pytest
import torch

from verispec.bench import environment


@pytest.mark.parametrize("cpu, flags, kind", [
    ("Intel(R) Xeon(R) Processor", ["avx2", "avx512f", "amx_bf16"], "xeon"),
    ("AMD EPYC", ["avx2", "avx512f", "avx512_bf16"], "zen4"),
    ("AMD EPYC", ["avx2"], "zen3"),
    ("Apple M2 Pro", [], "apple-m2-pro"),
])
def test_a_cpu_machine_kind(monkeypatch, cpu, flags, kind):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(environment, "_cpu_model", lambda: cpu)
    monkeypatch.setattr(environment, "_cpu_flags", lambda: flags)
    assert environment.machine_kind() == kind


@pytest.mark.parametrize("gpu, kind", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-40GB", "a100"),
                                       ("NVIDIA GeForce RTX 4090", "rtx4090"), ("Tesla T4", "t4")])
def test_a_gpu_machine_kind(monkeypatch, gpu, kind):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: gpu)
    assert environment.machine_kind() == kind
