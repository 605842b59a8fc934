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
# over 2 ranks' halves), and AdamW carries that through 12 steps. Measured: the losses as logged (4
# decimals) equal, the fc weights within 4e-9 after 12 steps.
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


def _data_folder(path: Path) -> Path:
    """A data folder laid out like ../shared/data (ShareGPT + GSM8K train), in the tiny word vocabulary."""
    from server_helpers import WORDS

    def conv(i):
        words = " ".join(WORDS[(i * 7 + j) % 40] for j in range(3 + i % 5))
        return {"conversations": [{"from": "human", "value": f"{words} ?"}]}

    (path / "sharegpt").mkdir(parents=True)
    (path / "gsm8k").mkdir()
    (path / "sharegpt" / "ShareGPT_V3_filtered_500.json").write_text(json.dumps([conv(i) for i in range(80)]))
    (path / "sharegpt" / "sg_90k_part1_html_cleaned_lang_first_sampled_sorted.json").write_text(
        json.dumps([conv(i + 100) for i in range(80)]))
    (path / "gsm8k" / "train.jsonl").write_text("\n".join(json.dumps({"question": f"one two {WORDS[i % 40]} ?"})
                                                          for i in range(60)))
    return path


def test_train_command_under_torchrun_shards_the_data(tmp_path):
    """`torchrun --nproc-per-node 2 -m verispec train eagle`: the ranks share self-distillation and feature
    extraction (rank 0 merges the answers), train, and rank 0 saves the head; the answers are those of a
    1-process run."""
    from server_helpers import tiny_target

    target = tiny_target(seed=4)
    model = tmp_path / "tiny-words"
    target.model.save_pretrained(model)
    target.tokenizer.save_pretrained(model)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "VERISPEC_DATA": str(_data_folder(tmp_path / "data")),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    args = ["-m", "verispec", "train", "eagle", "--target", str(model), "--prompts", "24", "--max-new-tokens", "10",
            "--gen-batch", "4", "--steps", "3", "--batch-size", "2", "--seq-len", "8", "--ttt-steps", "2",
            "--draft-vocab", "32", "--eval-prompts", "0", "--eval-bench", "0", "--layout", "eagle3", "--no-progress",
            "--threads", "1"]
    results = {}
    for n in (2, 1):
        work = tmp_path / f"work{n}"
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-addr",
                  "127.0.0.1", "--master-port", str(free_port())] if n > 1 else [sys.executable]
        r = subprocess.run([*launch, *args, "--work", str(work)], capture_output=True, text=True, env=env, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        assert (work / "eagle-head" / "config.json").is_file() and not list(work.glob("answers.rank*"))
        rows = [json.loads(x) for x in (work / "answers.jsonl").read_text().splitlines()]
        results[n] = {x["id"]: x["answer_ids"] for x in rows}
        assert len(rows) == len(results[n])  # every prompt answered once
        if n == 2:
            assert r.stdout.count("eagle head:") == 1  # rank 0 reports
            assert json.loads((work / "eagle-head" / "config.json").read_text())["layout"] == "eagle3"
    assert results[2] == results[1]
    # a wider MLP (the capacity knob) trains on the same answers and features, from a training state of its own
    r = subprocess.run([sys.executable, *args, "--work", str(tmp_path / "work1"), "--head-intermediate", "40",
                        "--out", str(tmp_path / "wide")], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "wide" / "config.json").read_text())["intermediate_size"] == 40
    assert (tmp_path / "work1" / "eagle-eagle3-mlp40" / "trainer.pt").is_file()
    from verispec.drafters.eagle import load_eagle_head

    assert load_eagle_head(target, tmp_path / "wide").down.weight.shape == (target.model.config.hidden_size, 40)
