"""The machine a result was measured on (versions, CPU, threads), stored with every result so runs on
different machines can be compared."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from pathlib import Path

import torch


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> list[str]:
    """The instruction sets the CPU figures depend on (bf16 GEMMs, AMX, AVX-512), as /proc/cpuinfo names them."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    words = set(text.split())
    return [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8") if f in words]


def _git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _kernel_threads() -> int | None:
    """The threads the fast path's C++ kernels split a pass over (None on a CPU where they do not run)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    from verispec.fast import ops

    return ops.parallel_threads()


def machine_kind() -> str:
    """The folder results/ files a run under (results/<machine-kind>/<topic>/): the GPU's model where one
    runs (e.g. "h100"), else the CPU family whose instruction sets the figures depend on: "xeon", "zen4"
    (AMD with AVX-512), "zen3" (AMD with AVX2 only), or the processor's name for any other."""
    import re

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0).lower()
        found = re.search(r"\b([a-z]{1,3})[ -]?(\d{1,4}[a-z]?)\b", name)  # "H100 80GB HBM3", "RTX 4090", "T4"
        return "".join(found.groups()) if found else re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    cpu = _cpu_model()
    if "Xeon" in cpu:
        return "xeon"
    if "AMD" in cpu:
        return "zen4" if "avx512f" in _cpu_flags() else "zen3"
    return re.sub(r"[^a-z0-9]+", "-", cpu.lower()).strip("-") or "cpu"


def environment(target=None) -> dict:
    """Versions and hardware, stored with every result so runs on different machines can be compared."""
    import transformers

    import verispec

    env = {
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "verispec": verispec.__version__,
        "git_commit": _git_commit(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_flags": _cpu_flags(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "kernel_threads": _kernel_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cuda": torch.version.cuda,
    }
    try:
        import llama_cpp

        env["llama_cpp_python"] = llama_cpp.__version__
    except ImportError:
        env["llama_cpp_python"] = None
    if target is not None:
        env.update(model=target.name, dtype=str(target.dtype).replace("torch.", ""), device=str(target.device))
    return env
