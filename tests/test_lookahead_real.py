"""Lookahead decoding on the real SmolLM2-135M: greedy output equal to plain decoding token for token, in
float32 and in bfloat16 (the fast path in exact mode: the Jacobi window's rows ride in the verification
forward, and canonical attention keeps the committed tokens' bits)."""

from __future__ import annotations

import pytest

from conftest import fast_greedy_equals_plain

PROMPTS = ["List the first ten prime numbers: 2, 3, 5, 7,",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return"]


@pytest.mark.real_model
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_lookahead_equals_plain_greedy(dtype):
    from verispec.models import load_model

    target = load_model("smollm2-135m", dtype=dtype)
    accepted = fast_greedy_equals_plain(target, PROMPTS, 32, "lookahead", lookahead_window=4, lookahead_ngram=4,
                                        lookahead_candidates=4)
    assert accepted > 0
