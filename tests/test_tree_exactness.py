"""Greedy exactness with trees: token for token equal to plain greedy decoding (float32), for static and
dynamic trees, n-gram and draft-model drafters, and oracle drafters that put the right token at a random
sibling rank among distractors (so walks go through later siblings and stop at random depths), on tiny
random Llama / Gemma 3 models and on the real smollm2-135m and gemma3-270m."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import loaded, tiny_gemma3, tiny_llama
from verispec.api import build_engine
from verispec.drafters.base import Drafter
from verispec.engine import Engine
from verispec.tree import StaticTree
from verispec.types import Proposal, SamplingParams


pytestmark = pytest.mark.usefixtures("one_thread")


class OracleTreeDrafter(Drafter):
    """Knows the reference greedy continuation. Each step builds a random tree: along the true path each
    node offers 1-3 children with the true token at a random rank (missing with probability `miss`),
    and distractor nodes get random children too. Point masses: greedy verification ignores q."""

    name = "oracle"
    can_tree = True

    def __init__(self, reference: list[int], vocab: int, seed: int = 0, miss: float = 0.2):
        self.reference, self.vocab, self.miss = reference, vocab, miss
        self.rng = random.Random(seed)

    def begin(self, prompt, params, generator):
        self.full = list(prompt) + self.reference

    def propose(self, context, k):
        return Proposal(torch.tensor(self.full[len(context): len(context) + k] or [0]))

    def propose_tree(self, context, shape):
        depth = shape.depth
        tokens, parents = [], []
        truth = self.full[len(context): len(context) + depth]
        frontier = [(-1, 0, True)]  # (node, depth, on the true path)
        while frontier:
            node, d, on_path = frontier.pop(0)
            if d >= depth or (not on_path and self.rng.random() < 0.5):
                continue
            want = truth[d] if on_path and d < len(truth) and self.rng.random() >= self.miss else None
            m = self.rng.randint(1, 3)
            picks = self.rng.sample([t for t in range(self.vocab) if t != want], m)
            if want is not None:
                picks[self.rng.randrange(m)] = want
            for t in picks:
                tokens.append(t)
                parents.append(node)
                frontier.append((len(tokens) - 1, d + 1, t == want))
        return Proposal(torch.tensor(tokens), parents=parents)

    def observe(self, result):
        pass


def plain(target, prompt, n):
    return build_engine(target, backend="hf").generate(prompt, SamplingParams(max_new_tokens=n)).token_ids


TINY_PROMPTS = [[1, 2, 3, 4, 5, 6, 1, 2, 3, 7], [9, 9, 9, 9, 4, 9, 9, 9], [5, 17, 3, 28, 11, 5, 17]]
TINY = {"llama": tiny_llama, "gemma3": tiny_gemma3}


@pytest.mark.parametrize("family", list(TINY))
def test_tiny_models_trees_equal_plain_greedy(family):
    target = loaded(TINY[family]())
    configs = [
        ("ngram", {"tree": "static:medium"}),
        ("ngram", {"tree": "dynamic", "tree_budget": 12, "tree_topk": 3}),
        ("draft", {"tree": "static:small", "draft": loaded(TINY[family](seed=5))}),  # a random draft model
        ("draft", {"tree": "dynamic", "tree_depth": 4, "draft": target}),           # the target itself
    ]
    for prompt in TINY_PROMPTS:
        ref = plain(target, prompt, 24)
        for method, kw in configs:
            engine = build_engine(target, method, backend="hf", **kw)
            got = engine.generate(prompt, SamplingParams(max_new_tokens=24))
            assert got.token_ids == ref, (method, kw.get("tree"))
            assert got.stats.tree_steps > 0 and got.stats.nodes_verified == got.stats.drafted
        oracle = OracleTreeDrafter(ref, 32, seed=len(prompt))
        engine = Engine.for_model(target, oracle, backend="hf", tree=StaticTree.named("large"))
        got = engine.generate(prompt, SamplingParams(max_new_tokens=24))
        assert got.token_ids == ref
        assert got.stats.accepted > 0 and any(a > 0 for a in got.stats.accepted_by_rank[1:])


def test_self_draft_static_tree_accepts_whole_top_path():
    """Draft = target: the rank-0 path is the target's greedy path, so every step accepts to full depth."""
    target = loaded(tiny_llama())
    engine = build_engine(target, "draft", draft=target, tree="static:medium", backend="hf")
    got = engine.generate(TINY_PROMPTS[0], SamplingParams(max_new_tokens=30))
    assert got.token_ids == plain(target, TINY_PROMPTS[0], 30)
    depth = StaticTree.named("medium").depth
    assert got.stats.accepted_depth_counts[depth] >= got.stats.steps - 1  # the last step may be cut by room


REAL_PROMPTS = [
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village by the sea, there lived",
    "List the first ten prime numbers: 2, 3, 5, 7,",
    "Question: What is 12 times 12?\nAnswer:",
]


@pytest.fixture(scope="module")
def gemma3_270m():
    from verispec.models import load_model

    return load_model("gemma3-270m", dtype="float32")


def _real_model_check(target):
    for i, text in enumerate(REAL_PROMPTS):
        ids = target.encode(prompt=text)
        ref = plain(target, ids, 64)
        for tree in ("static:medium", "dynamic"):
            got = build_engine(target, "ngram", tree=tree, backend="hf").generate(ids, SamplingParams(max_new_tokens=64))
            assert got.token_ids == ref, (text, tree)
        oracle = OracleTreeDrafter(ref, target.vocab_size, seed=i)
        got = Engine.for_model(target, oracle, backend="hf", tree=StaticTree.named("medium")).generate(
            ids, SamplingParams(max_new_tokens=64))
        assert got.token_ids == ref, (text, "oracle")
        assert got.stats.mean_accepted_length > 1.5


@pytest.mark.real_model
def test_smollm2_trees_equal_plain_greedy(smollm2):
    _real_model_check(smollm2)


@pytest.mark.real_model
def test_gemma3_trees_equal_plain_greedy(gemma3_270m):
    _real_model_check(gemma3_270m)
