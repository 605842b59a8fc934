"""The shipped EAGLE and Medusa heads on the real embedded SmolLM2-135M (float32): greedy output equals
plain greedy decoding token for token (5 prompts x 64 tokens), as chains and trees, and the heads
really draft (some drafts accepted)."""

from __future__ import annotations

import pytest

from verispec.api import build_engine
from verispec.heads import shipped_head
from verispec.types import SamplingParams

pytestmark = pytest.mark.real_model

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "Natalie has 12 apples and gives 5 to her friend. How many apples does she have left? Explain step by step.",
    "Explain what a hash table is to a beginner programmer.",
    "List three tips for staying productive when working from home.",
]


@pytest.fixture(scope="module")
def plain(smollm2):
    engine = build_engine(smollm2, "ar")
    return [engine.generate(smollm2.encode(chat=p), SamplingParams(max_new_tokens=64)).token_ids for p in PROMPTS]


def test_heads_are_shipped_and_small():
    for kind in ("eagle", "medusa"):
        path = shipped_head("smollm2-135m", kind)
        assert path is not None, f"no shipped {kind} head"
        assert (path / "model.safetensors").stat().st_size <= 20 * 2**20


@pytest.mark.parametrize("method,tree", [("eagle", None), ("eagle", "dynamic"), ("medusa", None),
                                         ("medusa", "static:medium")])
def test_shipped_heads_greedy_exact(smollm2, plain, method, tree):
    engine = build_engine(smollm2, method, draft_length=4, tree=tree)
    accepted = 0
    for prompt, want in zip(PROMPTS, plain):
        g = engine.generate(smollm2.encode(chat=prompt), SamplingParams(max_new_tokens=64))
        assert g.token_ids == want, prompt
        accepted += g.stats.accepted
    assert accepted > 0  # a trained head gets drafts accepted (a broken feature hook would get ~none)
