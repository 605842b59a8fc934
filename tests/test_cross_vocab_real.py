"""Gemma 3 270M verified with the SmolLM2-135M draft (another tokenizer): greedy output equal to plain
decoding token for token, in float32 and in bfloat16 (exact mode), on the fast path."""

from __future__ import annotations

import pytest

from conftest import fast_greedy_equals_plain
from verispec.drafters import CrossVocabularyDrafter

PROMPTS = ["The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return"]


@pytest.mark.real_model
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemma3_with_smollm2_draft_equals_plain_greedy(dtype):
    from verispec.models import load_model

    target = load_model("gemma3-270m", dtype=dtype)
    draft = load_model("smollm2-135m", dtype=dtype)
    accepted = fast_greedy_equals_plain(target, PROMPTS, 16, "draft", draft=draft, draft_length=4,
                                        check=lambda engine: isinstance(engine.drafter, CrossVocabularyDrafter))
    assert accepted > 0  # the two models agree on some of this text: drafts were used, not only refused
