"""`verispec bench --baselines openai:URL`: an OpenAI-compatible server measured on the same questions in
the same run as the in-process methods. The server here is `verispec serve` itself, started in the test
as a subprocess on a tiny model saved to disk; the bench loads the same folder in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from server_helpers import free_port, tiny_target
from verispec.bench import harness
from verispec.bench.baselines import OpenAIContender, split_baselines
from verispec.bench.prompts import Question
from verispec.errors import InvalidParameter

pytestmark = pytest.mark.usefixtures("one_thread")

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model folder, base URL) of `verispec serve` running the tiny model."""
    folder = tmp_path_factory.mktemp("tiny-words")
    target = tiny_target(seed=3)
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "verispec", "serve", "--model", str(folder), "--port", str(port),
                             "--threads", "1", "--log-level", "warning"], env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"verispec serve did not start: {proc.stderr.read()[-2000:]}")
            time.sleep(0.3)
    yield folder, url
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def questions():
    return [Question("q1", "writing", ["the cat sat on the mat and the dog ran"]),
            Question("q2", "coding", ["python code function string list", "what is it ?"])]


def test_split_baselines():
    assert split_baselines("hf,openai:http://h:1/v1,model=m,label=v,hf-pld") == [
        "hf", "openai:http://h:1/v1,model=m,label=v", "hf-pld"]
    with pytest.raises(InvalidParameter, match="http"):
        OpenAIContender("openai:h:1", None)
    with pytest.raises(InvalidParameter, match="model=, label="):
        OpenAIContender("openai:http://h:1,colour=red", None)


def test_bench_measures_verispec_serve_beside_in_process_methods(served):
    from verispec.models import load_model

    folder, url = served
    target = load_model(str(folder), dtype="float32")
    res = harness.run_bench(target, ["ar", "ngram"], questions(), baselines=[f"openai:{url}/v1,label=served"],
                            max_new_tokens=12, warmup=1, progress=False)
    labels = [c["label"] for c in res["config"]["contenders"]]
    assert labels[-1] == "served" and not res["config"]["skipped_contenders"]
    served_cfg = res["config"]["contenders"][-1]
    assert served_cfg["kind"] == "baseline" and served_cfg["options"]["token_ids"] == "from the server"
    runs = [r for r in res["runs"] if r["method"] == "served"]
    assert len(runs) == 2 and all(r["new_tokens"] > 0 and r["time_s"] > 0 for r in runs)
    assert sum(len(r["turns"]) for r in runs) == 3  # the second question's two turns, each continuing its own chat
    # the same greedy decoding behind a socket: every output equals plain decoding in-process
    assert res["mismatches"] == []
    ref = {r["question_index"]: r for r in res["runs"] if r["method"] == "ar"}
    for r in runs:
        assert [t["token_ids"] for t in r["turns"]] == [t["token_ids"] for t in ref[r["question_index"]]["turns"]]
    s = res["summary"]["served"]["overall"]
    assert s["tokens_per_second"] > 0 and s["speedup"] is not None


def test_bench_cli_with_an_openai_baseline(served, tmp_path):
    folder, url = served
    qfile = tmp_path / "q.jsonl"
    qfile.write_text(json.dumps({"question_id": "a", "category": "writing", "turns": ["the big red dog ran"]}) + "\n")
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "verispec", "bench", "--model", str(folder), "--method", "ar",
                        "--baselines", f"openai:{url},label=served", "--prompts", str(qfile), "--per-category", "0",
                        "--max-new-tokens", "8", "--threads", "1", "--no-plots", "--no-progress", "--out", str(out)],
                       capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert "served" in res["summary"] and res["mismatches"] == []
    assert "served" in r.stdout
    # an unreachable server: one line, exit 2
    bad = subprocess.run([sys.executable, "-m", "verispec", "bench", "--model", str(folder), "--method", "ar",
                          "--baselines", f"openai:http://127.0.0.1:{free_port()}/v1", "--prompts", str(qfile),
                          "--per-category", "0", "--max-new-tokens", "4", "--no-plots", "--no-progress",
                          "--out", str(tmp_path / "b.json")], capture_output=True, text=True, env=ENV, timeout=600)
    assert bad.returncode == 2 and "cannot reach" in bad.stderr and "Traceback" not in bad.stderr
