"""KV rollback: after every step (rejections included) the target's and the draft's caches equal a
fresh prefill of the sequence they claim to hold, on both backends (transformers and the fast path)."""

import pytest
import torch

from conftest import loaded, tiny_gemma3, tiny_llama
from verispec.api import build_engine
from verispec.backends import make_runner
from verispec.types import SamplingParams


def kv_entries(runner) -> list[torch.Tensor]:
    """The valid KV entries of every layer, positions 0..length-1, whatever the backend."""
    if hasattr(runner, "cache"):  # transformers DynamicCache
        return [t for layer in runner.cache.layers for t in (layer.keys, layer.values)]
    assert torch.equal(runner.slot_pos[: runner.length].cpu(), torch.arange(runner.length))
    return [t[:, : runner.length] for t in (*runner.k, *runner.v)]


def assert_cache_equals_prefill(model, runner, tokens: list[int], backend: str):
    assert runner.length == len(tokens)
    fresh = make_runner(model, backend)
    fresh.forward(tokens)
    got, ref = kv_entries(runner), kv_entries(fresh)
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        assert torch.allclose(g, r, atol=1e-5), float((g - r).abs().max())


@pytest.mark.parametrize("backend", ["hf", "fast"])
@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding-window-8"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_match_fresh_prefill_after_each_step(make, temperature, backend):
    target, draft = loaded(make(seed=0)), loaded(make(seed=4))
    engine = build_engine(target, "draft", draft=draft, draft_length=4, backend=backend)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    context = list(prompt)
    rejections = 0
    for event in engine.stream(prompt, SamplingParams(temperature=temperature, seed=0, max_new_tokens=30)):
        context += event.token_ids
        rejections += "recovered" in event.kinds
        assert_cache_equals_prefill(target.model, engine.runner, context[:-1], backend)
        drafter = engine.drafter
        # after observe() the draft cache holds committed tokens only (it catches up at the next proposal)
        assert drafter.cached == context[: len(drafter.cached)]
        assert_cache_equals_prefill(draft.model, drafter.runner, drafter.cached, "hf" if hasattr(drafter.runner, "cache") else "fast")
    assert rejections > 0, "the test needs rejections to exercise rollback"
