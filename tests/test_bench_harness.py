"""The bench harness on tiny models: a smoke bench (2 questions, 16 tokens) producing a valid results file
and plots, multi-turn conversations, method alternation, a planted greedy mismatch, the summary math,
the shipped prompt sets, and the CLI end to end (bench, roofline, report) on a saved tiny model."""

from __future__ import annotations

import json

import pytest

from conftest import loaded, tiny_llama
from verispec.bench import harness, prompts, report
from verispec.bench.baselines import MethodSpec, VerispecContender, parse_method
from verispec.errors import InvalidParameter

PNG = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.usefixtures("one_thread")


def byte_tokenizer():
    """A small real tokenizer (byte-level, 258 ids) with a chat template, built here without downloads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for s in ("<|im_start|>", "<|im_end|>"):
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>")
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return fast


@pytest.fixture(scope="module")
def chat_model():
    from verispec.models.loader import from_model

    return from_model(tiny_llama(vocab=258, seed=1), byte_tokenizer(), name="tiny-chat")


@pytest.fixture(scope="module")
def draft_model():
    from verispec.models.loader import from_model

    return from_model(tiny_llama(vocab=258, seed=2, layers=1), byte_tokenizer(), name="tiny-draft")


def two_questions():
    qs = prompts.sample(prompts.group_tasks(prompts.load_prompts("spec_bench")), 1, seed=0, only=["mt_bench", "qa"])
    assert [q.category for q in qs] == ["mt_bench", "qa"] and len(qs[0].turns) == 2
    return qs


@pytest.fixture(scope="module")
def smoke(chat_model, draft_model, tmp_path_factory):
    qs = two_questions()
    res = harness.run_bench(chat_model, ["ar", "ngram", "draft:draft_length=3"], qs, draft=draft_model,
                            baselines=["hf", "hf-pld", "hf-assisted"], max_new_tokens=16, progress=False,
                            prompt_set="spec_bench")
    files = report.write_bench(res, tmp_path_factory.mktemp("bench") / "smoke.json")
    return res, files


def test_smoke_bench_results_file(smoke):
    res, files = smoke
    data = json.loads(files["json"].read_text())
    assert data["schema"] == "verispec-bench/1"
    labels = ["ar", "ngram", "draft", "hf", "hf-pld", "hf-assisted"]
    assert [c["label"] for c in data["config"]["contenders"]] == labels
    assert len(data["runs"]) == 2 * len(labels)
    env = data["environment"]
    for key in ("torch", "transformers", "cpu", "torch_threads", "dtype", "python"):
        assert env[key] not in (None, "")
    for label in labels:
        overall = data["summary"][label]["overall"]
        assert overall["questions"] == 2 and overall["new_tokens"] > 0 and overall["tokens_per_second"] > 0
        assert set(data["summary"][label]["categories"]) == {"mt_bench", "qa"}
    assert data["summary"]["ar"]["overall"]["speedup"] == pytest.approx(1.0)
    # verispec's lossless methods reproduce plain greedy decoding exactly
    assert [m for m in data["mismatches"] if m["kind"] == "verispec"] == []
    for label in ("ngram", "draft"):
        o = data["summary"][label]["overall"]
        assert o["matches_plain"] == 2
        assert o["drafted"] > 0 and 0 <= o["acceptance_rate"] <= 1
        assert 1.0 <= o["mean_accepted_length"] <= 1 + 5
        assert o["predicted_speedup_flat"] > 0 and 0 <= o["draft_share"] <= 1
    assert data["summary"]["draft"]["overall"]["mean_draft_length"] <= 3
    # the speedup is the ratio of tokens per second to plain decoding's over the same questions
    ng, ar = data["summary"]["ngram"]["overall"], data["summary"]["ar"]["overall"]
    assert ng["speedup"] == pytest.approx(ng["tokens_per_second"] / ar["tokens_per_second"])
    for key in ("markdown", "speedup_png", "acceptance_png", "throughput_png"):
        assert files[key].exists()
    for key in ("speedup_png", "acceptance_png", "throughput_png"):
        assert files[key].read_bytes()[:8] == PNG
    md = files["markdown"].read_text()
    assert "| ngram | overall | 2 |" in md and "MISMATCH" not in md


def test_multi_turn_uses_own_answer(smoke, chat_model):
    res, _ = smoke
    run = next(r for r in res["runs"] if r["method"] == "ar" and r["question_index"] == 0)
    t1, t2 = run["turns"]
    q = res["questions"][0]
    conv = harness.Conversation(chat_model, chat=True)
    assert conv.ask(q["turns"][0]) == chat_model.encode(chat=[{"role": "user", "content": q["turns"][0]}])
    assert len(chat_model.encode(chat=[{"role": "user", "content": q["turns"][0]}])) == t1["prompt_tokens"]
    messages = [{"role": "user", "content": q["turns"][0]},
                {"role": "assistant", "content": chat_model.decode(t1["token_ids"])},
                {"role": "user", "content": q["turns"][1]}]
    assert t2["prompt_tokens"] == len(chat_model.encode(chat=messages))


def test_methods_alternate_question_by_question(smoke):
    res, _ = smoke
    order = {}
    for r in res["runs"]:
        order.setdefault(r["question_index"], []).append(r["method"])
    first, second = list(order.values())
    assert sorted(first) == sorted(second) and first != second
    assert second[0] == first[1]  # the order rotates by one


def test_planted_mismatch_is_detected(chat_model, tmp_path):
    class Broken(VerispecContender):
        """A 'lossless' method with a planted bug: token 5 of every answer is changed."""

        def generate(self, prompt_ids, max_new_tokens):
            out, stats = super().generate(prompt_ids, max_new_tokens)
            if len(out) > 5:
                out = out[:5] + [(out[5] + 1) % 256] + out[6:]
            return out, stats

    broken = Broken(chat_model, MethodSpec("ngram", label="broken-ngram"))
    res = harness.run_bench(chat_model, ["ar", broken], two_questions()[1:], max_new_tokens=16, progress=False)
    assert len(res["runs"][0]["turns"][0]["token_ids"]) > 5
    assert res["mismatches"] == [{"question_index": 0, "question_id": res["questions"][0]["question_id"], "category": "qa",
                                  "method": "broken-ngram", "kind": "verispec", "turn": 0, "first_difference_at": 5,
                                  "plain_tokens": 16, "method_tokens": 16}]
    assert res["summary"]["broken-ngram"]["overall"]["matches_plain"] == 0
    md = report.markdown(res)
    assert "!!! GREEDY OUTPUT MISMATCHES !!!" in md and "LOSSLESS METHOD DIFFERS" in md
    text, _ = report.compare([report.write_json(res, tmp_path / "b.json")])
    assert "LOSSLESS METHOD DIFFERS" in text


def test_a_baseline_that_raises_is_reported_and_the_bench_goes_on(chat_model):
    class Flaky(VerispecContender):
        """A foreign baseline that works in warm-up and then fails on a real question."""

        kind = "baseline"
        calls = 0

        def generate(self, prompt_ids, max_new_tokens):
            Flaky.calls += 1
            if Flaky.calls > 2:
                raise ValueError("could not broadcast input array")
            return super().generate(prompt_ids, max_new_tokens)

    flaky = Flaky(chat_model, MethodSpec("ar", label="flaky"))
    res = harness.run_bench(chat_model, ["ar", "ngram", flaky], two_questions(), max_new_tokens=8, progress=False)
    assert "could not broadcast" in res["config"]["skipped_contenders"]["flaky"]
    assert {r["method"] for r in res["runs"]} == {"ar", "ngram"} and "flaky" not in res["summary"]
    assert len(res["runs"]) == 2 * len(res["questions"])


def test_raw_prompt_mode_with_number_tokenizer(tmp_path):
    target = loaded(tiny_llama())
    jl = tmp_path / "q.jsonl"
    jl.write_text('{"question_id": 1, "category": "nums", "turns": ["1 2 3 4 1 2 3 4", "5 6"]}\n'
                  '{"turns": ["7 8 9"]}\n{"question_id": 1, "turns": ["3 3"]}\n')
    qs = prompts.load_prompts(str(jl))
    assert [q.category for q in qs] == ["nums", "q", "q"]
    assert [q.question_id for q in qs] == ["1", "line2", "1#2"]
    with pytest.raises(InvalidParameter, match="chat template"):
        harness.run_bench(target, ["ar"], qs, prompt_mode="chat", progress=False)
    res = harness.run_bench(target, ["ngram"], qs, max_new_tokens=8, progress=False)
    assert res["config"]["prompt_mode"] == "raw"
    ar = next(r for r in res["runs"] if r["method"] == "ar" and r["question_index"] == 0)
    # raw multi-turn: turn 2 = turn 1 prompt + its own answer + turn 2's tokens
    assert ar["turns"][1]["prompt_tokens"] == 8 + ar["turns"][0]["new_tokens"] + 2
    assert res["mismatches"] == [], (res["mismatches"], [(r["method"], [t["token_ids"] for t in r["turns"]]) for r in res["runs"]])


def test_summary_math_on_synthetic_runs():
    def run(qid, method, tokens, secs, stats=None):
        return {"question_id": qid, "category": "c", "method": method, "kind": "verispec", "question_index": 0,
                "new_tokens": tokens, "time_s": secs,
                "turns": [{"prompt_tokens": 3, "new_tokens": tokens, "time_s": secs, "token_ids": [1] * tokens,
                           "stats": stats}]}

    ar_stats = {"steps": 10, "drafted": 0, "accepted": 0, "committed": 10, "draft_time": 0.0, "verify_time": 1.0,
                "prefill_time": 0.0, "drafted_by_position": [], "accepted_by_position": []}
    sp_stats = {"steps": 4, "drafted": 12, "accepted": 6, "committed": 10, "draft_time": 0.12, "verify_time": 0.48,
                "prefill_time": 0.0, "drafted_by_position": [4, 4, 4], "accepted_by_position": [3, 2, 1]}
    runs = [run("1", "ar", 10, 1.0, ar_stats), run("1", "sp", 10, 0.5, sp_stats)]
    s = harness.summarize(runs)["sp"]["overall"]
    assert s["speedup"] == pytest.approx(2.0)
    assert s["decode_speedup"] == pytest.approx(2.0)  # no prefill: the same ratio
    # a prefill of 0.3 s in both: end to end 1.3 / 0.8, decoding alone 1.0 / 0.5
    pre = [run("1", "ar", 10, 1.3, dict(ar_stats, prefill_time=0.3)), run("1", "sp", 10, 0.8, dict(sp_stats, prefill_time=0.3))]
    p = harness.summarize(pre)["sp"]["overall"]
    assert p["speedup"] == pytest.approx(1.3 / 0.8) and p["decode_speedup"] == pytest.approx(2.0)
    assert p["decode_tokens_per_second"] == pytest.approx(20.0)
    assert s["mean_accepted_length"] == pytest.approx(2.5) and s["acceptance_rate"] == pytest.approx(0.5)
    assert s["acceptance_by_position"] == pytest.approx([0.75, 0.5, 0.25])
    assert s["draft_share"] == pytest.approx(0.2)
    # c = (0.12 / 12) / (1.0 / 10) = 0.1, k = 3: predicted = 2.5 / (0.3 + 1)
    assert s["draft_cost_ratio"] == pytest.approx(0.1)
    assert s["predicted_speedup_flat"] == pytest.approx(2.5 / 1.3)
    from verispec.theory import CostCurve

    s2 = harness.summarize(runs, CostCurve([1, 4], [1.0, 1.6]))["sp"]["overall"]
    assert s2["predicted_speedup_curve"] == pytest.approx(2.5 / (0.3 + 1.6))


def test_shipped_prompt_sets():
    sb = prompts.load_prompts("spec_bench")
    assert len(sb) == 384 and len(prompts.categories(sb)) == 13
    grouped = prompts.group_tasks(sb)
    assert prompts.categories(grouped) == ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]
    assert grouped[0].extra["subcategory"] == "writing"
    four = prompts.sample(grouped, 4, seed=0)
    assert len(four) == 24 and four == prompts.sample(grouped, 4, seed=0)
    assert len(prompts.load_prompts("mt_bench")) == 64
    gsm = prompts.load_prompts("gsm8k")
    assert len(gsm) == 1239 and gsm[0].turns[0].startswith("Janet")
    he = prompts.load_prompts("humaneval")
    assert len(he) == 164 and he[0].question_id == "HumanEval/0" and "def has_close_elements" in he[0].turns[0]
    for name in ("spec_bench", "mt_bench", "gsm8k", "humaneval"):
        folder = prompts.SETS[name].parent
        assert (folder / "SOURCE.md").exists() and (folder / "LICENSE").exists()


def test_bad_inputs(tmp_path, chat_model):
    with pytest.raises(InvalidParameter):
        prompts.load_prompts("no-such-set")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": []}\n')
    with pytest.raises(InvalidParameter):
        prompts.load_prompts(str(bad))
    bad.write_text("{not json\n")
    with pytest.raises(InvalidParameter, match="not JSON"):
        prompts.load_prompts(str(bad))
    with pytest.raises(InvalidParameter):
        prompts.sample(prompts.load_prompts("mt_bench"), 1, only=["nope"])
    with pytest.raises(InvalidParameter):
        parse_method("ngram:draft_length=0")
    with pytest.raises(InvalidParameter):
        parse_method("ngram:oops")
    with pytest.raises(InvalidParameter, match="unknown method"):
        harness.run_bench(chat_model, ["nope"], two_questions(), progress=False)
    with pytest.raises(InvalidParameter):
        harness.run_bench(chat_model, ["ngram:no_such_option=1"], two_questions(), progress=False)


def test_parse_method_passthrough():
    spec = parse_method("ngram:draft_length=4,ngram_max=2,label=pld,adaptive=true")
    assert spec.method == "ngram" and spec.draft_length == 4 and spec.label == "pld"
    assert spec.options == {"ngram_max": 2, "adaptive": True}
    assert parse_method("draft", draft_length=7).draft_length == 7


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    """A tiny model with the byte tokenizer saved as a model directory, so the CLI can load it by path."""
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_llama(vocab=258, seed=1).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def test_cli_smoke_bench_roofline_report(saved_tiny, tmp_path):
    from typer.testing import CliRunner

    from verispec.cli import app

    cli = CliRunner()
    roof = tmp_path / "roof.json"
    r = cli.invoke(app, ["roofline", "--model", str(saved_tiny), "--max-n", "8", "--context", "16", "--repeats", "2",
                         "--warmup", "1", "--out", str(roof), "--no-progress"])
    assert r.exit_code == 0, r.output
    assert "free positions" in r.output and roof.with_suffix(".png").read_bytes()[:8] == PNG
    out = tmp_path / "bench.json"
    r = cli.invoke(app, ["bench", "--model", str(saved_tiny), "--method", "ar", "--method", "ngram:draft_length=3",
                         "--method", "ngram:tree=static:small", "--per-category", "1", "--category", "mt_bench,qa", "--max-new-tokens", "16",
                         "--baselines", "hf,llamacpp", "--roofline", str(roof), "--out", str(out), "--no-progress"])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert len(data["questions"]) == 2 and "predicted_speedup_curve" in data["summary"]["ngram"]["overall"]
    assert "| ngram[tree=static:small] |" in r.output  # labels are printed as text, not as rich markup
    from verispec.bench.baselines import llamacpp_available

    if not llamacpp_available():  # an optional baseline that cannot run is reported, not dropped silently
        assert "llama-cpp-python" in data["config"]["skipped_contenders"]["llamacpp"]
        assert "not run: llamacpp" in r.output
    assert data["cost_curve"]["ns"] == [1, 2, 4, 8]
    for suffix in ("_speedup.png", "_acceptance.png", "_throughput.png"):
        assert (tmp_path / f"bench{suffix}").read_bytes()[:8] == PNG
    r = cli.invoke(app, ["report", str(out), str(out), str(roof), "--out", str(tmp_path / "cmp")])
    assert r.exit_code == 0, r.output
    assert "## Roofline" in r.output and "| ngram |" in r.output
    assert (tmp_path / "cmp" / "compare_bench.png").read_bytes()[:8] == PNG
    assert (tmp_path / "cmp" / "compare_roofline.png").exists()
    # bad input: one line, exit code 2
    for args in (["bench", "--model", str(saved_tiny), "--prompts", "nope.jsonl"],
                 ["bench", "--model", str(saved_tiny), "--baselines", "vllm"],
                 ["bench", "--model", str(saved_tiny), "--method", "draft"],
                 ["report", str(roof.with_suffix(".png"))],
                 ["roofline", "--model", str(saved_tiny), "--context", "500", "--max-n", "64"]):
        r = cli.invoke(app, args)
        assert r.exit_code == 2, (args, r.output)
        assert "error:" in r.output and "Traceback" not in r.output


@pytest.mark.real_model
def test_real_model_chat_bench(smollm2):
    """SmolLM2 through its own chat template, a two-turn MT-Bench question: the n-gram method and
    transformers' baselines run, and verispec's outputs equal plain decoding's."""
    qs = prompts.sample(prompts.load_prompts("mt_bench"), 1, seed=0, only=["writing"])
    res = harness.run_bench(smollm2, ["ar", "ngram"], qs, baselines=["hf"], max_new_tokens=8,
                            warmup=0, progress=False)
    assert res["config"]["prompt_mode"] == "chat"
    assert [m for m in res["mismatches"] if m["kind"] == "verispec"] == []
    ar = next(r for r in res["runs"] if r["method"] == "ar")
    assert len(ar["turns"]) == 2 and all(t["new_tokens"] > 0 for t in ar["turns"])
    assert "assistant" in smollm2.tokenizer.decode(smollm2.encode(chat=[{"role": "user", "content": "hi"}]))
    assert set(res["summary"]) == {"ar", "ngram", "hf"}


def test_a_broken_llama_cpp_install_counts_as_not_installed(monkeypatch):
    """A llama_cpp that is found but fails to import (e.g. built without its dependencies) makes the
    baseline 'not run', not a traceback in the middle of a bench."""
    import importlib.util
    import sys

    from verispec.bench import baselines

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "llama_cpp" else None)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # importing it raises ImportError
    assert baselines.llamacpp_available() is False


def test_llama_cpp_extra_buffer_types_off_for_one_load_only(monkeypatch):
    """VERISPEC_LLAMACPP_EXTRA_BUFTS=0 (llama.cpp's AMX kernels fault in some VMs): the model loads with
    use_extra_bufts False, and llama-cpp-python's defaults are back afterwards, also after an error."""
    import sys
    import types

    from verispec.bench.baselines import _extra_buffer_types

    params = types.SimpleNamespace
    binding = types.SimpleNamespace(llama_model_default_params=lambda: params(use_extra_bufts=True))
    module = types.ModuleType("llama_cpp.llama")
    module.llama_cpp = binding
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))
    monkeypatch.setitem(sys.modules, "llama_cpp.llama", module)
    sys.modules["llama_cpp"].llama = module
    original = binding.llama_model_default_params
    with _extra_buffer_types(True):
        assert binding.llama_model_default_params().use_extra_bufts is True
    with pytest.raises(RuntimeError):
        with _extra_buffer_types(False):
            assert binding.llama_model_default_params().use_extra_bufts is False
            raise RuntimeError("load failed")
    assert binding.llama_model_default_params is original


def test_llama_cpp_prefills_every_prompt_in_full():
    """llama-cpp-python's generate(reset=True) reuses cached tokens that match the prompt's start; the
    contender clears them first, so llama.cpp pays the prefill verispec's contenders pay."""
    from verispec.bench.baselines import LlamaCppContender

    calls = []

    class FakeLlama:  # records the order of calls; generate() as llama-cpp-python's: reuses what is cached
        def __init__(self):
            self.cached: list[int] = []

        def reset(self):
            calls.append("reset")
            self.cached = []

        def generate(self, tokens, **kw):
            reused = len(self.cached) if self.cached == list(tokens[:len(self.cached)]) else 0
            calls.append(("prefill", len(tokens) - reused))
            self.cached = list(tokens)
            yield from (7, 8, 2)

    c = LlamaCppContender.__new__(LlamaCppContender)
    c.llm, c.eos = FakeLlama(), {2}
    assert c.generate([1, 2, 3, 4], 64) == ([7, 8], None)
    assert c.generate([1, 2, 3, 4, 5], 64) == ([7, 8], None)
    assert calls == ["reset", ("prefill", 4), "reset", ("prefill", 5)]
