"""The chain acceptance rules as pure functions: exact cases and empirical distributions."""

from collections import Counter

import pytest
import torch

from verispec.acceptance import greedy_verify, speculative_verify


def test_greedy_accepts_matching_prefix_then_target_token():
    logits = torch.full((4, 10), -5.0)
    logits[0, 3] = logits[1, 7] = logits[2, 2] = logits[3, 9] = 5.0
    r = greedy_verify(torch.tensor([3, 7, 1]), logits)
    assert (r.tokens, r.num_accepted, r.num_drafted, r.last_kind) == ([3, 7, 2], 2, 3, "recovered")
    r = greedy_verify(torch.tensor([3, 7, 2]), logits)
    assert (r.tokens, r.num_accepted, r.last_kind) == ([3, 7, 2, 9], 3, "bonus")
    r = greedy_verify(torch.tensor([], dtype=torch.long), logits[:1])
    assert r.tokens == [3] and r.num_accepted == 0


def test_acceptance_probability_is_min_one_p_over_q():
    # one drafted token x=0 with q(x)=0.8, p(x)=0.2 -> accepted with probability 0.25
    p = torch.tensor([[0.2, 0.8], [0.5, 0.5]])
    q = torch.tensor([[0.8, 0.2]])
    g = torch.Generator().manual_seed(0)
    n = 40_000
    acc = sum(speculative_verify(torch.tensor([0]), q, p, g).num_accepted for _ in range(n))
    assert abs(acc / n - 0.25) < 4 * (0.25 * 0.75 / n) ** 0.5


@pytest.mark.parametrize("point_mass", [False, True])
def test_first_token_is_distributed_as_p(point_mass):
    """Draft x ~ q, then the rule: the emitted first token must follow p exactly."""
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([0.4, 0.1, 0.1, 0.1, 0.3])
    n = 40_000
    counts = Counter()
    for _ in range(n):
        x = torch.multinomial(q, 1, generator=g)
        res = speculative_verify(x, None if point_mass else q[None], p, g)
        counts[res.tokens[0]] += 1
    for t in range(5):
        expect = float(p[0, t])
        sd = (expect * (1 - expect) / n) ** 0.5
        assert abs(counts[t] / n - expect) <= 5 * sd + 1e-9, (t, counts[t] / n, expect)
    assert counts[4] == 0  # never emits a token the target gives probability zero


def test_bonus_token_after_full_accept_comes_from_last_position():
    p = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    r = speculative_verify(torch.tensor([0]), None, p, torch.Generator().manual_seed(0))
    assert r.tokens == [0, 2] and r.last_kind == "bonus"
