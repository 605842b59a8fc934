"""Suffix decoding in front of a trained drafter (drafters/hybrid.py, methods suffix+eagle, ...): which drafter
drafts a step, greedy output equal to plain decoding, the sampled output's exact distribution, and that the
free proposals do not teach the auto budget."""

from __future__ import annotations

import pytest
import torch

from conftest import loaded, tiny_llama
from verispec.api import build_engine
from verispec.drafters import METHODS
from verispec.drafters.base import Drafter
from verispec.drafters.hybrid import HybridDrafter
from verispec.drafters.suffix import SuffixCache, make_suffix_drafter
from verispec.engine import Engine
from verispec.errors import InvalidParameter
from verispec.tree import DynamicTree
from verispec.types import Proposal, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


class Idle(Drafter):
    name = "idle"


class Counting(Drafter):
    """Wraps a drafter and counts the steps it was asked to draft."""

    def __init__(self, inner: Drafter):
        self.inner, self.calls = inner, 0
        self.name, self.can_tree, self.feature_layers = inner.name, inner.can_tree, inner.feature_layers

    def begin(self, prompt, params, generator):
        self.inner.begin(prompt, params, generator)

    def propose(self, context, k):
        self.calls += 1
        return self.inner.propose(context, k)

    def propose_tree(self, context, shape):
        self.calls += 1
        return self.inner.propose_tree(context, shape)

    def observe_features(self, features):
        self.inner.observe_features(features)

    def observe(self, result):
        self.inner.observe(result)


class CountingHybrid(HybridDrafter):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.free = 0

    def propose_free(self, context, depth, nodes, tree):
        got = super().propose_free(context, depth, nodes, tree)
        self.free += got is not None
        return got


def test_the_suffix_speculation_is_taken_from_its_score_up():
    """A context that repeats itself: the suffix tries expect several accepted tokens, so the hybrid offers
    their tree as a free proposal; above that score the trained drafter is asked instead (None)."""
    ctx = [5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 5, 6, 7, 8]
    for tree in (True, False):
        hybrid = HybridDrafter(make_suffix_drafter("t", cache="off"), Counting(Idle()), min_score=1.0)
        hybrid.begin(ctx, SamplingParams(), None)
        got = hybrid.propose_free(ctx, 8, 16, tree)
        assert got is not None and got.tokens.tolist()[:3] == [9, 10, 11]
        assert (got.parents is not None) == tree
        spec = hybrid.suffix.best(ctx, 16, topk=None if tree else 1, max_depth=8)
        high = HybridDrafter(make_suffix_drafter("t", cache="off"), Counting(Idle()), min_score=spec.score + 0.01)
        high.begin(ctx, SamplingParams(), None)
        assert high.propose_free(ctx, 8, 16, tree) is None
    with pytest.raises(InvalidParameter, match="min_score"):
        HybridDrafter(make_suffix_drafter("t", cache="off"), Idle(), min_score=-1)


@pytest.mark.parametrize("backend,dtype", [("fast", torch.float32), ("fast", torch.bfloat16), ("hf", torch.float32)])
@pytest.mark.parametrize("tree", [None, "dynamic"])
def test_greedy_output_equals_plain_decoding(backend, dtype, tree):
    """Random EAGLE heads behind suffix decoding on prompts that repeat: both kinds of step happen, and the
    output is plain decoding's, token for token (fast path: exact mode)."""
    from test_heads import random_eagle
    from verispec.drafters.eagle import EagleDrafter

    target = loaded(tiny_llama(vocab=48, seed=3, dtype=dtype), name=f"tiny-hybrid-{backend}-{dtype}")
    prompts = [[1, 5, 9, 2, 7, 1, 5, 9, 2], [3, 4, 3, 4, 3, 4, 3], [7, 7, 7, 7, 7, 7, 1, 2, 3, 11, 40, 2]]
    params = SamplingParams(max_new_tokens=32)
    model = Counting(EagleDrafter(random_eagle(target, vocab=24), target.vocab_size))
    hybrid = CountingHybrid(make_suffix_drafter("tiny", cache=SuffixCache()), model)
    engine = Engine.for_model(target, hybrid, draft_length=4, tree=DynamicTree(budget=8) if tree else None,
                              backend=backend)
    for prompt in prompts * 2:  # the second round also drafts from the cross-request cache
        plain = Engine.for_model(target, None, backend=backend).generate(prompt, params).token_ids
        got = engine.generate(prompt, params)
        if backend == "fast":
            assert got.token_ids == plain, prompt
        else:
            from test_exactness import assert_same_or_tie

            assert_same_or_tie(target.model, prompt, plain, got.token_ids, f"suffix+eagle {tree}")
    assert hybrid.free > 0 and model.calls > 0


def test_sampled_output_matches_the_target_distribution():
    """Sampling at temperature 1: steps drafted from the suffix tries (point masses, any shape) and steps of
    a drafter with its own q (test_tree_distribution's tables) in one run; the first three tokens must follow
    the target's exact distribution."""
    from test_tree_distribution import MIXED, PROMPT, Table, TableRunner, TableTreeDrafter, check
    from verispec.tree import parse_tree

    target = Table(0)
    params = SamplingParams(temperature=0.9, top_k=5, top_p=0.99)
    model = Counting(TableTreeDrafter(Table(10, scale=1.5), ["iid", "point", "wor", "point"]))
    hybrid = CountingHybrid(make_suffix_drafter("table", cache=SuffixCache(), alpha=2.0, min_prob=0.0), model,
                            min_score=1.5)
    engine = Engine(TableRunner(target), set(), lambda ids: "", 1000, drafter=hybrid, tree=parse_tree(MIXED))
    samples = []
    for i in range(4000):
        g = engine.generate(PROMPT, SamplingParams(max_new_tokens=3, seed=i, temperature=params.temperature,
                                                   top_k=params.top_k, top_p=params.top_p))
        samples.append(tuple(g.token_ids))
    check(samples, target.exact(PROMPT, params))
    assert hybrid.free > 500 and model.calls > 500


def test_free_steps_do_not_teach_the_auto_budget():
    """The auto budget prices the trained drafter's proposals from their acceptance by sibling rank; a step
    the suffix tries drafted says nothing about those, so it leaves the estimate as it was."""

    class Never(Drafter):
        name, can_tree = "never", True

        def propose_tree(self, context, shape):
            raise AssertionError("every step here has a confident suffix speculation")

    class Always(HybridDrafter):
        def propose_free(self, context, depth, nodes, tree):
            return Proposal(torch.tensor([context[-1]] * min(3, depth)), parents=[-1, 0, 1][:min(3, depth)])

    target = loaded(tiny_llama(vocab=48, seed=3), name="tiny-hybrid-budget")
    engine = Engine.for_model(target, Always(make_suffix_drafter("t", cache="off"), Never()), tree="dynamic",
                              backend="fast", verify_cost={1: 1.0, 4: 1.0, 8: 1.0, 16: 1.0, 32: 2.0, 64: 4.0})
    before = engine.budget.rank_acceptance.pooled()
    got = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=12))
    assert got.stats.drafted > 0
    assert engine.budget.rank_acceptance.pooled() == before


def test_the_methods_are_registered_and_build():
    target = loaded(tiny_llama(vocab=48, seed=3), name="tiny-hybrid-methods")
    for name in ("suffix+eagle", "suffix+dflash", "suffix+medusa"):
        assert name in METHODS
    with pytest.raises(Exception, match="head|eagle|train"):
        build_engine(target, "suffix+eagle")  # no head is shipped for a tiny model: the EAGLE factory's own error
