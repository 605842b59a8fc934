"""Speculative sampling is lossless: the first 3 tokens the engine emits are distributed exactly as the
target's own (temperature / top-k / top-p applied), whatever the drafter proposes.

Each case draws N sequences with the real Engine and compares them with the exactly enumerated target
distribution by chi-square tests (the joint of 3 tokens, and each position's marginal) at level 1e-3.
Seeds are fixed, so the tests are deterministic.

Power: the hardest 1% bias to see moves mass between the two most likely first tokens. test_power
draws N_POWER = 160,000 sequences for one representative case, computes the test's power against that
bias from the noncentral chi-square distribution (it must be >= 0.9999, so that one fixed set of seeds
is almost surely not the unlucky draw that hides the bias), and checks that the samples do fail
against the reference with 1% moved, and that a planted wrong rule (no residual after a
rejection) fails too. The edge cases use N = 20,000 each (env VERISPEC_DIST_N), which sees a 2% bias.
"""

from __future__ import annotations

import os

import pytest
import torch

from stats_util import chi_square_pvalue, marginals, shift_mass
from table_lm import DisjointDrafter, FixedDrafter, TableDrafter, TableLM
from verispec import acceptance
from verispec.drafters import DraftModelDrafter, NGramDrafter
from verispec.engine import Engine
from verispec.types import SamplingParams

N = int(os.environ.get("VERISPEC_DIST_N", "20000"))
N_POWER = int(os.environ.get("VERISPEC_DIST_N_POWER", "160000"))
ALPHA = 1e-3
PROMPT = [1, 2, 3, 1, 2]


def draw(engine: Engine, n: int, prompt=PROMPT, **kw) -> list[tuple]:
    out = []
    for i in range(n):
        g = engine.generate(prompt, SamplingParams(max_new_tokens=3, seed=i, **kw))
        out.append(tuple(g.token_ids))
    return out


def check(samples, exact):
    p_joint = chi_square_pvalue(samples, exact)
    p_marg = [chi_square_pvalue(*marginals(samples, exact, i)) for i in range(3)]
    assert p_joint > ALPHA and min(p_marg) > ALPHA, f"joint p={p_joint:.2e}, marginals {[f'{p:.2e}' for p in p_marg]}"


CASES = {
    # name: (drafter factory(target), draft_length, sampling kwargs)
    "p_equals_q": (lambda t: TableDrafter(t), 3, dict(temperature=1.0)),
    "other_model_topk_topp": (lambda t: TableDrafter(TableLM(6, seed=7)), 2, dict(temperature=0.8, top_k=4, top_p=0.9)),
    "draft_length_1": (lambda t: TableDrafter(TableLM(6, seed=8)), 1, dict(temperature=1.3)),
    "draft_length_8": (lambda t: TableDrafter(TableLM(6, seed=9, scale=1.0)), 8, dict(temperature=1.0, top_p=0.95)),
    "disjoint_supports": (lambda t: DisjointDrafter(t), 2, dict(temperature=1.0, top_k=2)),
    "point_mass_drafts": (lambda t: FixedDrafter(lambda i: (i * 5) % 6), 3, dict(temperature=0.7, top_p=0.8)),
    "ngram_point_masses": (lambda t: NGramDrafter(max_n=2), 4, dict(temperature=1.2, top_k=5)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_first_three_tokens_match_target(case):
    make, k, kw = CASES[case]
    target = TableLM(6, seed=0)
    engine = Engine(target, set(), lambda ids: "", 1000, drafter=make(target), draft_length=k)
    samples = draw(engine, N, **kw)
    exact = target.exact_distribution(PROMPT, SamplingParams(**kw))
    check(samples, exact)
    if case == "p_equals_q":
        assert engine.last.stats.acceptance_rate == 1.0
    if case == "disjoint_supports":
        assert engine.last.stats.accepted == 0


def test_top_k_1_is_deterministic_whatever_the_draft():
    target = TableLM(6, seed=0)
    engine = Engine(target, set(), lambda ids: "", 1000, drafter=TableDrafter(TableLM(6, seed=3)), draft_length=4)
    samples = draw(engine, 300, temperature=1.0, top_k=1)
    greedy = Engine(target, set(), lambda ids: "", 1000).generate(PROMPT, SamplingParams(max_new_tokens=3))
    assert set(samples) == {tuple(greedy.token_ids)}


def power_against_one_percent(exact: dict[tuple, float], n: int) -> float:
    """Power of the first-token chi-square test at level ALPHA against 1% moved between the two most
    likely first tokens (noncentrality n * sum(delta^2 / p))."""
    from scipy import stats

    first: dict[int, float] = {}
    for key, p in exact.items():
        first[key[0]] = first.get(key[0], 0.0) + p
    top = sorted(first.values(), reverse=True)
    lam = n * (0.01 ** 2 / top[0] + 0.01 ** 2 / top[1])
    df = len(top) - 1
    return float(1 - stats.ncx2.cdf(stats.chi2.ppf(1 - ALPHA, df), df, lam))


def test_power_planted_bias_and_wrong_rule_fail(monkeypatch):
    """The test has the power to see a 1% bias, and a rule that skips the residual update fails it."""
    kw = dict(temperature=1.0, top_p=0.95)
    target = TableLM(6, seed=0)
    exact = target.exact_distribution(PROMPT, SamplingParams(**kw))
    engine = Engine(target, set(), lambda ids: "", 1000, drafter=TableDrafter(TableLM(6, seed=7)), draft_length=3)
    samples = draw(engine, N_POWER, **kw)
    check(samples, exact)  # the right rule passes
    assert power_against_one_percent(exact, N_POWER) >= 0.9999
    top2 = sorted({k[0] for k in exact}, key=lambda t: -sum(p for k, p in exact.items() if k[0] == t))[:2]
    s, e = marginals(samples, shift_mass(exact, 0.01, top2[0], top2[1]), 0)
    assert chi_square_pvalue(s, e) < ALPHA, "a 1% bias in the first token went undetected"

    def no_residual(draft, draft_probs, target_probs, generator):
        # wrong on purpose: after a rejection, sample from p instead of normalize(max(0, p - q))
        res = right_rule(draft, draft_probs, target_probs, generator)
        if res.num_accepted < res.num_drafted:
            res.tokens[-1] = int(torch.multinomial(target_probs[res.num_accepted], 1, generator=generator))
        return res

    right_rule = acceptance.speculative_verify
    monkeypatch.setattr("verispec.acceptance.speculative_verify", no_residual)
    wrong = draw(engine, N, **kw)
    p_joint = chi_square_pvalue(wrong, exact)
    p_first = chi_square_pvalue(*marginals(wrong, exact, 0))
    assert min(p_joint, p_first) < ALPHA, "a rule without the residual update went undetected"


def test_real_draft_model_on_tiny_transformers_models():
    """The independent draft-model drafter with tiny random Llama models (vocab 8), sampled end to end."""
    from conftest import tiny_llama

    target = tiny_llama(vocab=8, seed=0, layers=1, hidden=16)
    draft = tiny_llama(vocab=8, seed=5, layers=1, hidden=16)
    with torch.no_grad():  # soften the logits so that several tokens are likely at each step
        target.lm_head.weight.mul_(0.15)
        draft.lm_head.weight.mul_(0.15)
    from verispec.backends.transformers import HFRunner

    kw = dict(temperature=1.0, top_p=0.95)
    engine = Engine(HFRunner(target), set(), lambda ids: "", 512, drafter=DraftModelDrafter(draft, 8), draft_length=2)
    n = 5000
    samples = draw(engine, n, prompt=[1, 2, 3], **kw)
    # exact target distribution by enumerating all 8 + 64 continuations in two batched forwards
    params = SamplingParams(**kw)
    prompt = torch.tensor([1, 2, 3])
    with torch.inference_mode():
        p1 = torch.nn.functional.softmax(target(prompt[None]).logits[0, -1], -1)
        from verispec.sampling import logits_to_probs

        p1 = logits_to_probs(target(prompt[None]).logits[0, -1], params)
        seq1 = torch.cat([prompt.repeat(8, 1), torch.arange(8)[:, None]], 1)
        p2 = logits_to_probs(target(seq1).logits[:, -1], params)  # [8, 8]
        seq2 = torch.cat([seq1.repeat_interleave(8, 0), torch.arange(8).repeat(8)[:, None]], 1)
        p3 = logits_to_probs(target(seq2).logits[:, -1], params).reshape(8, 8, 8)
    exact = {}
    for a in range(8):
        for b in range(8):
            for c in range(8):
                pr = float(p1[a] * p2[a, b] * p3[a, b, c])
                if pr > 0:
                    exact[(a, b, c)] = pr
    check(samples, exact)
