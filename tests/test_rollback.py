"""KV rollback: after every step (rejections included) the target's and the draft's caches equal a
fresh prefill of the sequence they claim to hold."""

import pytest
import torch

from conftest import loaded, tiny_gemma3, tiny_llama
from verispec.api import build_engine
from verispec.runner import HFRunner
from verispec.types import SamplingParams


def assert_cache_equals_prefill(model, runner: HFRunner, tokens: list[int]):
    assert runner.length == len(tokens)
    fresh = HFRunner(model)
    fresh.forward(tokens)
    for got, ref in zip(runner.cache.layers, fresh.cache.layers):
        assert got.keys.shape == ref.keys.shape
        assert torch.allclose(got.keys, ref.keys, atol=1e-5) and torch.allclose(got.values, ref.values, atol=1e-5)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding-window-8"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_match_fresh_prefill_after_each_step(make, temperature):
    target, draft = loaded(make(seed=0)), loaded(make(seed=4))
    engine = build_engine(target, "draft", draft=draft, draft_length=4)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    context = list(prompt)
    rejections = 0
    for event in engine.stream(prompt, SamplingParams(temperature=temperature, seed=0, max_new_tokens=30)):
        context += event.token_ids
        rejections += "recovered" in event.kinds
        assert_cache_equals_prefill(target.model, engine.runner, context[:-1])
        drafter = engine.drafter
        # the draft cache holds a prefix of the committed sequence (it catches up at the next proposal)
        assert drafter.cached == context[: len(drafter.cached)]
        assert_cache_equals_prefill(draft.model, drafter.runner, drafter.cached)
    assert rejections > 0, "the test needs rejections to exercise rollback"
