"""Training under torchrun (verispec/train/distributed.py): 2 processes on one CPU (gloo) train with the
same global batch as 1 process, so their losses match step by step; feature shards are split by rank;
an interrupted 2-process run resumes to the same losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from server_helpers import free_port

PROBE = Path(__file__).with_name("ddp_train_probe.py")
REPO = Path(__file__).resolve().parents[1]
STEPS = 12
# The same global batch and gradient: only the order of float additions differs (the gradient is summed
# over 2 ranks' halves), and AdamW carries that through 12 steps. Measured differences are ~1e-6.
TOLERANCE = 1e-4


def torchrun(n: int, work: Path, out: Path, *extra: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(PROBE), str(work), str(out),
                        str(STEPS), *extra], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    d = tmp_path_factory.mktemp("one")
    return torchrun(1, d / "work", d / "out.json")


def test_two_processes_match_one(one_process, tmp_path):
    two = torchrun(2, tmp_path / "work", tmp_path / "out.json")
    assert one_process["world"] == 1 and two["world"] == 2
    a, b = [h["loss"] for h in one_process["history"]], [h["loss"] for h in two["history"]]
    assert len(a) == len(b) == STEPS
    assert a[-1] < a[0]  # it trains
    for x, y in zip(a, b):
        assert abs(x - y) <= TOLERANCE * max(1.0, abs(x)), (a, b)
    for x, y in zip(one_process["fc"], two["fc"]):
        assert abs(x - y) <= TOLERANCE
    # feature shards were split between the ranks, and together they are all there
    assert len(list((tmp_path / "work" / "features").glob("shard_*.pt"))) == 4


def test_interrupted_two_process_run_resumes(one_process, tmp_path):
    first = torchrun(2, tmp_path / "work", tmp_path / "a.json", "0")  # time budget 0: stops after one step
    assert len(first["history"]) == 1
    resumed = torchrun(2, tmp_path / "work", tmp_path / "b.json")
    a, b = [h["loss"] for h in one_process["history"]], [h["loss"] for h in resumed["history"]]
    assert len(b) == STEPS
    for x, y in zip(a, b):
        assert abs(x - y) <= TOLERANCE * max(1.0, abs(x)), (a, b)
