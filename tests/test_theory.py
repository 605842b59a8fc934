"""theory.py: closed forms, inversion, cost curves, and simulations (pure and through the real engine loop)
that must agree with the expected-tokens formula."""

from __future__ import annotations

import math
import random

import pytest
import torch

from verispec import theory as th
from verispec.backends import Runner, Scores
from verispec.drafters.base import Drafter
from verispec.errors import InvalidParameter


@pytest.mark.parametrize("a,k", [(0.0, 3), (0.3, 1), (0.5, 2), (0.8, 4), (0.95, 7), (1.0, 5)])
def test_expected_tokens_is_the_geometric_sum(a, k):
    # E = sum_{i=0..k} a^i (a token for each accepted prefix, plus the bonus/recovered one)
    assert th.expected_tokens(a, k) == pytest.approx(sum(a ** i for i in range(k + 1)))


def test_expected_tokens_edge_cases():
    assert th.expected_tokens(1.0, 4) == 5.0
    assert th.expected_tokens(0.0, 9) == 1.0
    assert th.expected_tokens(0.7, 0) == 1.0
    assert th.expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert th.expected_accepted(0.5, 2) == pytest.approx(0.75)
    # continuous at a -> 1
    assert th.expected_tokens(1 - 1e-9, 6) == pytest.approx(7.0, rel=1e-6)


def test_speedup_leviathan_example():
    # a = 0.8, k = 4, c = 0.1: (1 - 0.8^5) / 0.2 / (4 * 0.1 + 1)
    assert th.speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8 ** 5) / 0.2 / 1.4)
    # free drafts: the speedup is the expected tokens
    assert th.speedup(0.6, 3, 0.0) == pytest.approx(th.expected_tokens(0.6, 3))


def test_optimal_k_is_the_argmax():
    for a, c in [(0.6, 0.05), (0.8, 0.1), (0.9, 0.02), (0.5, 0.3)]:
        k, s = th.optimal_k(a, c, k_max=20)
        brute = max(range(1, 21), key=lambda j: th.speedup(a, j, c))
        assert k == brute and s == pytest.approx(th.speedup(a, brute, c))
    # free drafts and a = 1: the longest draft wins
    assert th.optimal_k(1.0, 0.0, k_max=9)[0] == 9
    # expensive drafts and poor acceptance: nothing pays
    k, s = th.optimal_k(0.1, 1.0, k_max=8)
    assert k == 1 and s < 1.0


def test_acceptance_from_tokens_inverts():
    for a in (0.0, 0.2, 0.55, 0.9, 1.0):
        for k in (1, 3, 6):
            assert th.acceptance_from_tokens(th.expected_tokens(a, k), k) == pytest.approx(a, abs=1e-6)
    assert th.acceptance_from_tokens(0.5, 3) == pytest.approx(0.0, abs=1e-6)  # clamped


def test_cost_curve_interpolates_and_extrapolates():
    curve = th.CostCurve([1, 2, 4, 8], [10.0, 10.0, 12.0, 20.0])
    assert curve.ratio(1) == 1.0
    assert curve.ratio(3) == pytest.approx(1.1)
    assert curve.ratio(6) == pytest.approx(1.6)
    assert curve.ratio(16) == pytest.approx(3.6)  # 20 + 8 * 2 (slope of the last segment continued)
    # a flat measured curve gives Leviathan's formula back
    flat = th.CostCurve([1, 2, 4, 8, 16], [5.0] * 5)
    assert th.speedup(0.7, 5, 0.05, flat) == pytest.approx(th.speedup(0.7, 5, 0.05))
    # a steep curve (compute bound) makes long drafts cost, so the optimal k shrinks
    steep = th.CostCurve([1, 2, 4, 8, 16, 32], [1.0, 2.0, 4.0, 8.0, 16.0, 32.0])
    assert th.optimal_k(0.9, 0.0, steep, 16)[0] < th.optimal_k(0.9, 0.0, None, 16)[0]


def test_cost_curve_from_roofline_and_bad_input(tmp_path):
    data = {"points": [{"n": 1, "median_s": 0.01}, {"n": 4, "median_s": 0.02}]}
    assert th.CostCurve.from_roofline(data).ratio(4) == pytest.approx(2.0)
    p = tmp_path / "r.json"
    p.write_text("not json")
    with pytest.raises(InvalidParameter):
        th.CostCurve.from_roofline(p)
    with pytest.raises(InvalidParameter):
        th.CostCurve.from_roofline({"nothing": 1})
    with pytest.raises(InvalidParameter):
        th.CostCurve([2, 4], [1.0, 2.0])  # no N = 1


@pytest.mark.parametrize("bad", [(-0.1, 3, 0.1), (1.1, 3, 0.1), (0.5, -1, 0.1), (0.5, 3, -0.2)])
def test_bad_parameters_raise(bad):
    with pytest.raises(InvalidParameter):
        th.speedup(*bad)


@pytest.mark.parametrize("a,k", [(0.3, 2), (0.6, 4), (0.85, 6), (0.95, 3)])
def test_simulation_matches_formula(a, k):
    steps = 20000
    sim = th.simulate_tokens_per_step(a, k, steps=steps, seed=1)
    se = th.standard_error_tokens(a, k) / math.sqrt(steps)
    assert abs(sim - th.expected_tokens(a, k)) < 4.5 * se + 1e-12


class _CountingRunner(Runner):
    """Target whose greedy next token after t is (t + 1) % V: a runner interface with known answers."""

    def __init__(self, vocab: int = 11):
        self.vocab, self.length = vocab, 0

    def reset(self, params=None):
        self.length = 0

    def forward(self, ids, tree=None, *, last_only: bool = False, **_):
        ids = [int(i) for i in ids]
        logits = torch.full((len(ids), self.vocab), -10.0)
        for row, t in enumerate(ids):
            logits[row, (t + 1) % self.vocab] = 10.0
        self.length += len(ids)
        return Scores(logits[-1:] if last_only else logits)

    def rollback(self, length: int):
        self.length = min(self.length, length)


class _BernoulliDrafter(Drafter):
    """Drafts the right token with probability a at each position (a wrong one otherwise)."""

    name = "bernoulli"

    def __init__(self, a: float, vocab: int, seed: int = 0):
        self.a, self.vocab, self.rng = a, vocab, random.Random(seed)

    def begin(self, prompt, params, generator):
        pass

    def propose(self, context, k):
        from verispec.types import Proposal

        out, last = [], context[-1]
        for _ in range(k):
            right = (last + 1) % self.vocab
            tok = right if self.rng.random() < self.a else (last + 2) % self.vocab
            out.append(tok)
            last = tok
        return Proposal(tokens=torch.tensor(out, dtype=torch.long))

    def observe(self, result):
        pass


@pytest.mark.parametrize("a,k", [(0.5, 3), (0.8, 5)])
def test_engine_with_bernoulli_drafter_matches_formula(a, k):
    """The real decoding loop and SpecStats: a drafter accepted with probability a gives a mean accepted
    length (tokens per target forward) within tolerance of (1 - a^(k+1)) / (1 - a)."""
    from verispec.engine import Engine
    from verispec.types import SamplingParams

    vocab = 11
    engine = Engine(_CountingRunner(vocab), eos_ids=set(), decode=lambda ids: "", context_length=10 ** 7,
                    drafter=_BernoulliDrafter(a, vocab, seed=3), draft_length=k)
    gen = engine.generate([0, 1], SamplingParams(temperature=0.0, max_new_tokens=6000))
    # lossless: the output is the target's own greedy sequence
    assert gen.token_ids[:20] == [(2 + i) % vocab for i in range(20)]
    stats = gen.stats
    steps = stats.steps
    se = th.standard_error_tokens(a, k) / math.sqrt(steps)
    assert abs(stats.mean_accepted_length - th.expected_tokens(a, k)) < 5 * se + 0.01
    # and the acceptance implied by the measured tau is close to a
    assert th.acceptance_from_tokens(stats.mean_accepted_length, k) == pytest.approx(a, abs=0.04)


def test_theory_cli(tmp_path):
    import json

    from typer.testing import CliRunner

    from verispec.cli import app

    roof = tmp_path / "roof.json"
    roof.write_text(json.dumps({"points": [{"n": n, "median_s": 0.01 * (1 + 0.1 * n)} for n in (1, 2, 4, 8, 16)]}))
    res = CliRunner().invoke(app, ["theory", "-a", "0.8", "-c", "0.05", "--k-max", "6", "--roofline", str(roof)])
    assert res.exit_code == 0, res.output
    assert "optimal k (flat)" in res.output and "optimal k (measured cost)" in res.output
    best = th.optimal_k(0.8, 0.05, k_max=6)[0]
    assert f"optimal k (flat): {best} " in res.output
    bad = CliRunner().invoke(app, ["theory", "-a", "1.5"])
    assert bad.exit_code == 2 and "acceptance rate" in bad.output
