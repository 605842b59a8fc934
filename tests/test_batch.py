"""Batched speculative decoding (verispec/batch.py): many sequences, one target forward per step.

What must hold: a greedy sequence's tokens in a batch are its batch-1 tokens, bit for bit in exact mode
(bfloat16 included), whatever shares its batch, whenever it joined and whoever left; sequences draft
and accept ragged numbers of tokens in one shared forward; sampled sequences keep the target's exact
distribution; one cancelled sequence leaves the others alone; bad input gets one clear line.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import loaded, tiny_gemma3, tiny_llama
from stats_util import chi_square_pvalue
from test_heads import make_drafter
from verispec.api import build_engine
from verispec.batch import Batch, free_positions
from verispec.engine import Engine
from verispec.errors import InvalidParameter
from verispec.fast.decoder import FastDecoder
from verispec.types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

N_NEW = 20


def prompts_for(vocab: int, lengths=(4, 9, 17, 30, 6)) -> list[list[int]]:
    """Distinct prompts; the second repeats itself so prompt lookup drafts and accepts long runs."""
    out = [[int(x) for x in torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(n))] for n in lengths]
    out[1] = (out[1][:4] * 5)[:len(out[1]) + 8]
    return out


@pytest.fixture
def forwards(monkeypatch):
    """The number of sequences in each forward the fast decoder runs."""
    seen: list[int] = []
    real = FastDecoder.forward_parts

    def spy(self, parts, *a, **k):
        seen.append(len(parts))
        return real(self, parts, *a, **k)
    monkeypatch.setattr(FastDecoder, "forward_parts", spy)
    return seen


def run_batch(engines: list[Engine], prompts: list[list[int]], params: list[SamplingParams], max_batch: int,
              join_at: list[int] | None = None, positions: int | None = None):
    """Run every prompt through one Batch; prompt i joins at step join_at[i] (when there is room) -> the
    Decodings in prompt order and the events of each step."""
    batch = Batch(max_batch=max_batch, positions=positions)
    join_at = join_at or [0] * len(prompts)
    runs: list = [None] * len(prompts)
    steps = []
    step = 0
    while any(r is None for r in runs) or batch.active:
        for i, r in enumerate(runs):
            if r is None and join_at[i] <= step and not batch.full:
                runs[i] = batch.add(engines[i], prompts[i], params[i])
        steps.append(batch.step())
        step += 1
    return runs, steps


CASES = {
    "ar": lambda t: build_engine(t, method="ar"),
    "ngram": lambda t: build_engine(t, method="ngram", draft_length=4),
    "ngram_tree": lambda t: build_engine(t, method="ngram", tree="static:medium"),
    "suffix": lambda t: build_engine(t, method="suffix", suffix_cache="private"),
    "lookahead": lambda t: build_engine(t, method="lookahead"),
    "eagle_tree": lambda t: Engine.for_model(t, make_drafter("eagle", t), draft_length=4, tree="dynamic"),
    "medusa": lambda t: Engine.for_model(t, make_drafter("medusa", t), draft_length=3),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_batched_greedy_outputs_are_their_batch_one_outputs(family, dtype, forwards):
    """Every method, prompts of different lengths joining at different steps (one more prompt than the
    batch holds, so one joins when another leaves): each output is its batch-1 output token for token,
    and the steps really shared forwards."""
    model = (tiny_llama(vocab=48, seed=3, layers=3, hidden=64) if family == "llama" else
             tiny_gemma3(vocab=48, seed=3, layers=3, hidden=64)).to(dtype)
    t = loaded(model)
    prompts = prompts_for(48)
    params = [SamplingParams(max_new_tokens=N_NEW)] * len(prompts)
    for name, make in CASES.items():
        if family == "gemma3" and name in ("eagle_tree", "medusa"):
            continue  # the heads are built for the Llama fixture; their Gemma path is tested in test_heads
        solo = [make(t).generate(p, params[0]).token_ids for p in prompts]
        forwards.clear()
        runs, _ = run_batch([make(t) for _ in prompts], prompts, params, max_batch=4, join_at=[0, 0, 2, 5, 0])
        assert [r.result().token_ids for r in runs] == solo, (family, dtype, name)
        assert all(r.result().finish_reason == "length" for r in runs)
        assert max(forwards) >= 3, (name, forwards)  # sequences shared forwards


def test_ragged_drafts_and_acceptances_share_one_forward(forwards):
    """In one step one sequence accepts a long draft while another drafts nothing or loses its draft."""
    t = loaded(tiny_llama(vocab=48, seed=3, layers=3, hidden=64))
    prompts = prompts_for(48)[:3]
    engines = [build_engine(t, method="ngram", draft_length=6) for _ in prompts]
    params = [SamplingParams(max_new_tokens=N_NEW)] * 3
    forwards.clear()
    runs, steps = run_batch(engines, prompts, params, max_batch=3)
    assert forwards[:4] == [1, 1, 1, 3]  # three prefills alone, then steps shared
    per_step = [[len(e.token_ids) for _, e in step] for step in steps if len(step) == 3]
    assert any(len(set(counts)) > 1 for counts in per_step), per_step
    assert max(max(c) for c in per_step) >= 3  # a multi-token accept happened inside a shared step


def test_a_cancelled_sequence_leaves_the_others_untouched():
    t = loaded(tiny_llama(vocab=48, seed=3, layers=3, hidden=64))
    prompts = prompts_for(48)[:3]
    params = SamplingParams(max_new_tokens=N_NEW)
    solo = [build_engine(t, method="ngram").generate(p, params).token_ids for p in prompts]
    batch = Batch(max_batch=3)
    steps = {"n": 0}
    runs = [batch.add(build_engine(t, method="ngram"), p, params,
                      should_stop=(lambda: steps["n"] >= 3) if i == 1 else None) for i, p in enumerate(prompts)]
    cancelled = []
    while batch.active:
        for run, event in batch.step():
            if event is None:
                cancelled.append(run)
        steps["n"] += 1
    assert cancelled == [runs[1]] and runs[1].result().finish_reason == "cancelled"
    assert len(runs[1].result().token_ids) < N_NEW
    assert solo[1][:len(runs[1].result().token_ids)] == runs[1].result().token_ids
    assert [runs[0].result().token_ids, runs[2].result().token_ids] == [solo[0], solo[2]]
    batch2 = Batch(max_batch=2)  # cancel() from outside, mid-run
    a, b = (batch2.add(build_engine(t, method="ar"), p, params) for p in prompts[:2])
    batch2.step()
    batch2.cancel(a)
    while batch2.active:
        batch2.step()
    assert a.result().finish_reason == "cancelled" and b.result().token_ids == solo[1] and batch2.active == []


def test_the_positions_budget_shrinks_speculation_as_the_batch_grows():
    t = loaded(tiny_llama(vocab=48, seed=3, layers=3, hidden=64))
    prompts = prompts_for(48, lengths=(4, 9, 17, 30, 6, 12, 8, 5))
    params = [SamplingParams(max_new_tokens=N_NEW)] * len(prompts)
    solo = [build_engine(t, method="ngram", draft_length=6).generate(p, params[0]).token_ids for p in prompts]
    batch = Batch(max_batch=8, positions=8)
    runs = [batch.add(build_engine(t, method="ngram", draft_length=6), p, q) for p, q in zip(prompts, params)]
    assert batch.draft_share() == 0  # 8 sequences, 8 positions: plain decoding
    batch.step()
    assert all(r.stats.drafted == 0 for r in runs)
    while batch.active:
        share = batch.draft_share()
        before = [(r, r.stats.drafted) for r in batch.active]
        batch.step()
        assert all(r.stats.drafted - d <= share for r, d in before)
    assert [r.result().token_ids for r in runs] == solo  # a budget changes speed, never tokens
    assert Batch(max_batch=2, positions=16).draft_share() is None  # empty batch
    curve = {1: 1.0, 2: 1.05, 4: 1.2, 8: 1.3, 16: 2.0}
    assert free_positions(curve) == 4
    assert free_positions(curve, rows=4) == 8 and free_positions(curve, rows=16) == 16
    assert free_positions({1: 1.0, 2: 3.0}) == 1
    assert free_positions({1: 1.0, 2: 0.5, 4: 1.3}) == 2  # a measured dip counts as the cost before it
    # a cost curve instead of a fixed budget: the share follows the batch's size
    priced = Batch(max_batch=8, cost=curve)
    shares = []
    for p, q in zip(prompts, params):
        priced.add(build_engine(t, method="ngram", draft_length=6), p, q)
        shares.append(priced.draft_share())
    assert shares == [3, 3, 1, 1, 0, 0, 0, 0], shares  # 4 // 1 - 1, 8 // 2 - 1, 8 // 3 - 1, ..., 8 // 8 - 1
    while priced.active:
        priced.step()


def test_sampled_sequences_in_a_batch_keep_the_exact_distribution():
    """Sequences sampled side by side (each its own seed; a greedy one in the same batch, so passes of two
    modes run in one step) draw the first two tokens with the target's exact joint distribution, with a
    draft model whose q differs from p (rejections and residual draws happen)."""
    V = 8
    model = tiny_llama(vocab=V, seed=5, layers=2, hidden=32)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)  # spread the mass: many cells with visible probability
    t = loaded(model)
    draft = loaded(tiny_llama(vocab=V, seed=6, layers=1, hidden=32))
    prompt = [1, 2, 3, 1, 2]
    sampling = dict(temperature=1.0)
    with torch.no_grad():  # the exact joint of the first two tokens, from the transformers model
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), -1)
        ctx = torch.tensor([prompt + [a] for a in range(V)])
        second = torch.softmax(model(ctx).logits[:, -1].double(), -1)
    exact = {(a, b): float(first[a] * second[a, b]) for a, b in itertools.product(range(V), repeat=2)}
    B, rounds = 6, 500
    engines = [build_engine(t, method="draft", draft=draft, draft_length=2) for _ in range(B)]
    greedy = build_engine(t, method="ngram")
    samples = []
    for r in range(rounds):
        batch = Batch(max_batch=B + 1)
        runs = [batch.add(e, prompt, SamplingParams(max_new_tokens=2, seed=r * B + i, **sampling))
                for i, e in enumerate(engines)]
        batch.add(greedy, prompt, SamplingParams(max_new_tokens=2))
        while batch.active:
            batch.step()
        samples += [tuple(run.result().token_ids) for run in runs]
    assert sum(run.stats.drafted for run in runs) > 0
    p = chi_square_pvalue(samples, exact)
    assert p > 1e-3, p
    shifted = dict(exact)  # the same samples against a 5% wrong joint fail: the test has power here
    top = max(exact, key=exact.get)
    second_top = sorted(exact, key=exact.get)[-2]
    shifted[top] -= 0.05
    shifted[second_top] += 0.05
    assert chi_square_pvalue(samples, shifted) < 1e-3


def test_bad_batch_input_gets_one_clear_line():
    t = loaded(tiny_llama(vocab=48, seed=3))
    for kwargs in (dict(max_batch=0), dict(max_batch=2.5), dict(positions=0), dict(positions=4, cost={1: 1.0}),
                   dict(cost={2: 1.0})):
        with pytest.raises(InvalidParameter):
            Batch(**kwargs)
    with pytest.raises(InvalidParameter, match="cost of one"):
        free_positions({2: 1.0})
    batch = Batch(max_batch=1)
    engine = build_engine(t)
    batch.add(engine, [1, 2, 3], SamplingParams(max_new_tokens=4))
    with pytest.raises(InvalidParameter, match="holds 1 sequences"):
        batch.add(build_engine(t), [1, 2], SamplingParams(max_new_tokens=4))
    batch = Batch(max_batch=2)
    batch.add(engine, [1, 2, 3], SamplingParams(max_new_tokens=4))
    with pytest.raises(InvalidParameter, match="own engine"):
        batch.add(engine, [1, 2], SamplingParams(max_new_tokens=4))


@pytest.mark.real_model
def test_smollm2_bfloat16_batched_outputs_are_bit_identical_to_batch_one(forwards):
    """The real model in bfloat16, exact mode: four chat prompts joining at different steps, plain
    decoding, prompt lookup and the shipped EAGLE head's dynamic tree; each output is its batch-1 output."""
    from verispec.models import load_model

    target = load_model("smollm2-135m", dtype="bfloat16")
    questions = ["Name three rivers in Europe and one fact about each.", "What is 12 squared, and why?",
                 "Write two lines about autumn.", "Repeat after me: one, two, three, one, two, three."]
    prompts = [target.encode(chat=q) for q in questions]
    params = [SamplingParams(max_new_tokens=24)] * len(prompts)
    makers = {"ar": lambda: build_engine(target, "ar", backend="fast"),
              "ngram": lambda: build_engine(target, "ngram", backend="fast"),
              "eagle": lambda: build_engine(target, "eagle", backend="fast", tree="dynamic", tree_budget=8)}
    for name, make in makers.items():
        solo = [make().generate(p, params[0]).token_ids for p in prompts]
        forwards.clear()
        runs, _ = run_batch([make() for _ in prompts], prompts, params, max_batch=3, join_at=[0, 2, 0, 4])
        assert [r.result().token_ids for r in runs] == solo, name
        assert max(forwards) == 3, name


def test_generate_batch_api_returns_each_prompts_generate_output():
    from verispec import generate, generate_batch

    t = loaded(tiny_llama(vocab=48, seed=3, layers=3, hidden=64))
    texts = [" ".join(str(i) for i in p) for p in prompts_for(48)]
    want = [generate(t, p, method="ngram", max_new_tokens=12).token_ids for p in texts]
    got = generate_batch(t, texts, method="ngram", max_new_tokens=12, max_batch=2, positions=6)
    assert [g.token_ids for g in got] == want
    # sampling in exact mode: the same logits bits, so the same draws as alone with seed + i
    sampled = generate_batch(t, texts[:2], temperature=1.0, seed=7, max_new_tokens=6, max_batch=2, exact=True)
    assert [g.token_ids for g in sampled] == [generate(t, p, temperature=1.0, seed=7 + i, max_new_tokens=6,
                                                       exact=True).token_ids for i, p in enumerate(texts[:2])]
    auto = generate_batch(t, texts[:3], method="ngram", max_new_tokens=12, max_batch=3, positions="auto")
    assert [g.token_ids for g in auto] == want[:3]
    with pytest.raises(InvalidParameter, match="one of them"):
        generate_batch(t, texts, chats=[[{"role": "user", "content": "hi"}]])
    with pytest.raises(InvalidParameter, match="positions"):
        generate_batch(t, texts, positions="many")
