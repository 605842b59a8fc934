"""`verispec bench --batch-size` on tiny models: the result's fields, continuous admission (never more than B
live, a batch as large as the queue admits everything at once), every batched greedy output equal to plain
batch-1 decoding, a planted mismatch detected (and the CLI exiting 1), the percentile and parsing helpers,
and bad --batch-size / --batch-positions values giving one clear line."""

from __future__ import annotations

import json

import pytest

from test_bench_harness import PNG, byte_tokenizer, saved_tiny  # noqa: F401 - saved_tiny is a fixture
from conftest import tiny_llama
from verispec.batch import free_positions
from verispec.bench import batched, prompts, report
from verispec.errors import InvalidParameter

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def chat_model():
    from verispec.models.loader import from_model

    return from_model(tiny_llama(vocab=258, seed=1), byte_tokenizer(), name="tiny-chat")


def three_questions():
    """A two-turn MT-Bench question and two single-turn ones: 4 sequences, the follow-up turn queued late."""
    qs = prompts.sample(prompts.group_tasks(prompts.load_prompts("spec_bench")), 1, seed=0,
                        only=["mt_bench", "qa", "math_reasoning"])
    assert [len(q.turns) for q in qs] == [2, 1, 1]
    return qs


@pytest.fixture(scope="module")
def result(chat_model):
    return batched.run_batch_bench(chat_model, ["ar", "ngram:draft_length=3"], three_questions(), batch_sizes=[1, 2, 4],
                                   positions=[None, "auto"], max_new_tokens=12, progress=False, prompt_set="spec_bench")


def entry(res, label, b):
    return next(e for e in res["entries"] if e["label"] == label and e["batch_size"] == b)


def test_result_fields(result, tmp_path):
    res = result
    assert res["schema"] == "verispec-bench-batch/1"
    cfg = res["config"]
    assert cfg["batch_sizes"] == [1, 2, 4] and cfg["admission"] == "continuous"
    assert cfg["positions"] == [None, "auto"] and cfg["positions_resolved"] >= 1
    assert res["cost_curve"]["ns"][0] == 1 and len(res["cost_curve"]["ns"]) == len(res["cost_curve"]["times_s"])
    labels = [c["label"] for c in cfg["contenders"]]
    # plain decoding drafts nothing, so it runs once, without a budget
    assert labels == ["ar", "ngram", "ngram[positions=auto]"]
    assert [(e["label"], e["batch_size"]) for e in res["entries"]] == [(lab, b) for lab in labels for b in (1, 2, 4)]
    assert len(res["reference"]["sequences"]) == 4 and res["reference"]["tokens_per_second"] > 0
    for e in res["entries"]:
        s = e["summary"]
        assert s["sequences"] == 4 and s["questions"] == 3 and s["new_tokens"] > 0 and s["tokens_per_second"] > 0
        assert 0 < s["latency_p50_s"] <= s["latency_p95_s"]
        assert 0 < s["time_per_token_p50_s"] <= s["time_per_token_p95_s"]
        assert 1.0 <= s["mean_accepted_length"] <= 4.0
        assert 1.0 <= s["mean_occupancy"] <= e["batch_size"]
        assert s["speedup"] == pytest.approx(s["tokens_per_second"] / entry(res, "ar", 1)["summary"]["tokens_per_second"])
        assert s["matches_plain"] == 3
        assert len(e["load_average"]) == 2
    assert entry(res, "ar", 1)["summary"]["speedup"] == pytest.approx(1.0)
    assert entry(res, "ar", 2)["summary"]["mean_accepted_length"] == 1.0
    assert entry(res, "ngram", 1)["summary"]["positions_per_step"] > 1.0
    # auto: the budget follows the batch's size (batch.free_positions at B rows), reported at each B
    curve = dict(zip(res["cost_curve"]["ns"], res["cost_curve"]["times_s"]))
    assert res["config"]["positions_resolved"] == free_positions(curve)
    for b in (1, 2, 4):
        budget = free_positions(curve, rows=b)
        assert entry(res, "ngram[positions=auto]", b)["positions"] == budget >= b
        assert entry(res, "ngram[positions=auto]", b)["summary"]["draft_cap"] == max(0, budget // b - 1)
    assert res["mismatches"] == []
    # slot i of every contender shares one runner (one KV cache per slot), each engine has its own drafter
    assert res["memory"] == {"max_rss_mib": res["memory"]["max_rss_mib"], "engines": 12, "runners": 4}
    files = report.write_batch_bench(res, tmp_path / "b.json")
    data = json.loads(files["json"].read_text())
    assert data["command"] and data["entries"][0]["sequences"][0]["token_ids"]
    md = files["markdown"].read_text()
    assert "| ngram[positions=auto] | 4 |" in md and "MISMATCH" not in md
    assert files["batch_png"].read_bytes()[:8] == PNG


def test_every_batched_output_equals_plain_batch1(result):
    ref = {(s["question_index"], s["turn"]): s["token_ids"] for s in result["reference"]["sequences"]}
    assert all(len(t) == 12 for t in ref.values())
    for e in result["entries"]:
        assert {(s["question_index"], s["turn"]): s["token_ids"] for s in e["sequences"]} == ref, (e["label"], e["batch_size"])


def test_continuous_admission(result):
    for e in result["entries"]:
        seqs, b = e["sequences"], e["batch_size"]
        for s in seqs:  # never more than B live at once
            live = [o for o in seqs if o["admitted_s"] <= s["admitted_s"] < o["finished_s"]]
            assert len(live) <= b, (e["label"], b)
        second = next(s for s in seqs if s["turn"] == 1)
        first = next(s for s in seqs if s["question_index"] == second["question_index"] and s["turn"] == 0)
        assert second["admitted_s"] >= first["finished_s"]  # a follow-up waits for its own answer
        if b >= 3:  # room for every first turn: all admitted before anything finished
            firsts = [s for s in seqs if s["turn"] == 0]
            assert max(s["admitted_s"] for s in firsts) < min(s["finished_s"] for s in seqs)
        if b == 1:  # one at a time
            order = sorted(seqs, key=lambda s: s["admitted_s"])
            assert all(a["finished_s"] <= n["admitted_s"] for a, n in zip(order, order[1:]))


def test_trees_in_a_batch(chat_model):
    """A dynamic tree's budget comes from one cost curve measured before the timed runs, set on every
    engine; tree outputs in a batch equal plain batch-1 decoding too."""
    res = batched.run_batch_bench(chat_model, ["ngram:tree=dynamic,label=tree", "ngram:tree=static:small,label=static"],
                                  three_questions(), batch_sizes=[1, 3], max_new_tokens=10, progress=False)
    assert res["mismatches"] == [] and res["cost_curve"]["ns"][0] == 1
    assert [e["summary"]["matches_plain"] for e in res["entries"]] == [3] * 6
    assert entry(res, "tree", 3)["summary"]["positions_per_step"] > entry(res, "ar", 3)["summary"]["positions_per_step"]


def test_planted_mismatch_is_detected(chat_model, monkeypatch):
    real = batched.run_continuous

    def broken(target, engines, questions, chat, batch_size, positions, max_new_tokens, cost=None):
        run = real(target, engines, questions, chat, batch_size, positions, max_new_tokens, cost=cost)
        if batch_size == 2:  # a planted bug: token 3 of the second question's answer changes at B=2
            s = next(s for s in run["sequences"] if s["question_index"] == 1)
            s["token_ids"][3] = (s["token_ids"][3] + 1) % 256
        return run

    monkeypatch.setattr(batched, "run_continuous", broken)
    qs = three_questions()
    res = batched.run_batch_bench(chat_model, ["ar"], qs, batch_sizes=[1, 2], max_new_tokens=8, warmup=0, progress=False)
    assert res["mismatches"] == [{"method": "ar", "kind": "verispec", "batch_size": 2, "positions": None, "question_index": 1,
                                  "question_id": qs[1].question_id, "category": "qa", "turn": 0,
                                  "first_difference_at": 3, "plain_tokens": 8, "method_tokens": 8}]
    assert entry(res, "ar", 2)["summary"]["matches_plain"] == 2 and entry(res, "ar", 1)["summary"]["matches_plain"] == 3
    md = report.batch_markdown(res)
    assert "!!! GREEDY OUTPUT MISMATCHES !!!" in md and "BATCHED OUTPUT DIFFERS FROM PLAIN BATCH-1" in md


def test_helpers():
    assert batched.parse_batch_sizes([]) == [1, 2, 4, 8, 16]
    assert batched.parse_batch_sizes(["4,1", "2", 4]) == [1, 2, 4]
    for bad in (["0"], ["x"], ["1.5"], [-3], ["2,-1"]):
        with pytest.raises(InvalidParameter, match="batch size"):
            batched.parse_batch_sizes(bad)
    assert [batched.parse_positions(v) for v in ("auto", "none", "12", 3, None)] == ["auto", None, 12, 3, None]
    for bad in ("0", "lots", -1):
        with pytest.raises(InvalidParameter, match="batch positions"):
            batched.parse_positions(bad)
    assert batched.percentile([], 50) is None
    assert batched.percentile([3.0], 95) == 3.0
    assert batched.percentile([4.0, 1.0, 2.0, 3.0], 50) == pytest.approx(2.5)
    assert batched.percentile([float(i) for i in range(1, 21)], 95) == pytest.approx(19.05)


def test_bad_inputs(chat_model):
    with pytest.raises(InvalidParameter, match="no questions"):
        batched.run_batch_bench(chat_model, ["ar"], [], progress=False)
    with pytest.raises(InvalidParameter, match="unknown method"):
        batched.run_batch_bench(chat_model, ["nope"], three_questions(), batch_sizes=[1], progress=False)
    with pytest.raises(InvalidParameter, match="share a label"):
        batched.run_batch_bench(chat_model, ["ngram", "ngram:draft_length=2,label=ngram"], three_questions(),
                                batch_sizes=[1], progress=False)


def test_cli_batch_bench(saved_tiny, tmp_path, monkeypatch):  # noqa: F811 - the fixture
    from typer.testing import CliRunner

    from verispec.cli import app

    cli = CliRunner()
    out = tmp_path / "batch.json"
    base = ["bench", "--model", str(saved_tiny), "--per-category", "1", "--category", "mt_bench,qa", "--max-new-tokens", "8",
            "--no-progress", "--out", str(out)]
    r = cli.invoke(app, base + ["--method", "ar", "--method", "ngram", "--batch-size", "2,4", "--batch-positions", "6"])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["schema"] == "verispec-bench-batch/1" and data["command"]
    # B=1 runs for plain decoding even when not asked: it is the speedup reference
    assert [(e["label"], e["batch_size"]) for e in data["entries"]] == [
        ("ar", 1), ("ar", 2), ("ar", 4), ("ngram[positions=6]", 2), ("ngram[positions=6]", 4)]
    assert "| ngram[positions=6] | 4 | 6 |" in r.output and "plain, unbatched" in r.output
    assert out.with_suffix(".md").exists() and (tmp_path / "batch_batch.png").read_bytes()[:8] == PNG
    r = cli.invoke(app, ["report", str(out)])  # `verispec report` renders a batched result too
    assert r.exit_code == 0, r.output
    assert "## Batched: batch" in r.output and "| ngram[positions=6] | 2 | 6 |" in r.output

    real = batched.run_continuous

    def broken(*args, **kwargs):
        run = real(*args, **kwargs)
        run["sequences"][0]["token_ids"][0] += 1
        return run

    monkeypatch.setattr(batched, "run_continuous", broken)
    r = cli.invoke(app, base + ["--method", "ar", "--batch-size", "1", "--warmup", "0"])
    assert r.exit_code == 1, r.output
    assert "GREEDY MISMATCH" in r.output and "differs from plain batch-1" in r.output
    monkeypatch.setattr(batched, "run_continuous", real)

    # bad input: one line, exit code 2, nothing run
    for extra in (["--batch-size", "0"], ["--batch-size=-2"], ["--batch-size", "x"], ["--batch-size", "1.5"],
                  ["--batch-size", "2", "--batch-positions", "0"], ["--batch-size", "2", "--batch-positions", "many"],
                  ["--batch-positions", "auto"], ["--batch-size", "2", "--baselines", "hf"]):
        r = cli.invoke(app, base + extra)
        assert r.exit_code == 2, (extra, r.output)
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in r.output, (extra, r.output)
