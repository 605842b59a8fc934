"""Tree verification through the model's own mask and position inputs: every node's logits equal those
of running its own root-to-node path as a plain sequence (Llama, and Gemma 3 with a sliding window
shorter than the sequence), and after a tree step the KV caches equal a fresh prefill of the accepted
sequence (target and draft model)."""

from __future__ import annotations

import pytest
import torch

from conftest import loaded, tiny_gemma3, tiny_llama
from verispec.api import build_engine
from verispec.errors import UnsupportedModel
from verispec.backends import TreeMask
from verispec.backends.transformers import HFRunner, build_tree_mask, tree_mask_plan
from verispec.tree import TreeLayout, path_to
from verispec.types import SamplingParams


pytestmark = pytest.mark.usefixtures("one_thread")

# 12 nodes, depth up to 7: with 13 context tokens the deepest paths (20 tokens) exceed Gemma's window 8
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 3, 6, 8, 9, 10]
MODELS = {"llama": tiny_llama, "gemma3": tiny_gemma3}


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(0, 32, (13,), generator=g).tolist()
    toks = torch.randint(0, 32, (len(PARENTS),), generator=g).tolist()
    return ctx, toks


def _path_logits(model, ctx, toks, parents, i):
    return HFRunner(model).forward(ctx + [toks[j] for j in path_to(parents, i)]).logits[-1]


@pytest.mark.parametrize("family", list(MODELS))
def test_node_logits_equal_their_path_run_alone(family):
    model = MODELS[family]()
    ctx, toks = _case()
    runner = HFRunner(model)
    runner.forward(ctx)
    lay = TreeLayout.from_parents(PARENTS)
    logits = runner.forward(toks, tree=TreeMask(lay.mask, lay.depths)).logits
    assert logits.shape == (len(PARENTS), 32) and runner.length == len(ctx) + len(PARENTS)
    for i in range(len(PARENTS)):
        torch.testing.assert_close(logits[i], _path_logits(model, ctx, toks, PARENTS, i), atol=2e-5, rtol=1e-5)


def test_gemma_sliding_window_is_applied():
    """The same tree with the window ignored gives different logits for the deep nodes: the test above
    really exercises the sliding-window mask."""
    model = tiny_gemma3(sliding_window=4)
    assert tree_mask_plan(model) == {"sliding_attention": 4, "full_attention": None}
    ctx, toks = _case(1)
    lay = TreeLayout.from_parents(PARENTS)
    runner = HFRunner(model)
    runner.forward(ctx)
    good = runner.forward(toks, tree=TreeMask(lay.mask, lay.depths)).logits
    runner.rollback(len(ctx))
    n, total = len(PARENTS), len(ctx) + len(PARENTS)
    allowed = torch.ones(n, total, dtype=torch.bool)
    allowed[:, len(ctx):] = lay.mask
    pos = torch.cat([torch.arange(len(ctx)), len(ctx) + lay.depths])
    no_window = build_tree_mask({"sliding_attention": None, "full_attention": None}, allowed, pos[-n:], pos, torch.float32)
    bad = runner.run_model(toks, attention_mask=no_window, position_ids=pos[-n:][None]).logits
    deep = 11
    torch.testing.assert_close(good[deep], _path_logits(model, ctx, toks, PARENTS, deep), atol=2e-5, rtol=1e-5)
    assert (bad[deep] - good[deep]).abs().max() > 1e-3


@pytest.mark.parametrize("family", list(MODELS))
def test_tree_grown_over_several_calls(family):
    """The tree_start extension a draft model uses: earlier tree nodes already in the cache."""
    model = MODELS[family]()
    ctx, toks = _case(2)
    lay = TreeLayout.from_parents(PARENTS)
    runner = HFRunner(model)
    runner.forward(ctx)
    first = runner.forward(toks[:5], tree=TreeMask(lay.mask[:5, :5], lay.depths[:5])).logits
    rest = runner.forward(toks[5:], tree=TreeMask(lay.mask[5:], lay.depths, len(ctx))).logits
    logits = torch.cat([first, rest])
    for i in range(len(PARENTS)):
        torch.testing.assert_close(logits[i], _path_logits(model, ctx, toks, PARENTS, i), atol=2e-5, rtol=1e-5)


def _assert_cache_equals_prefill(runner: HFRunner, model, ids: list[int]):
    fresh = HFRunner(model)
    fresh.forward(ids)
    assert runner.length == len(ids)
    for a, b in zip(runner.cache.layers, fresh.cache.layers):
        assert a.keys.shape == b.keys.shape
        torch.testing.assert_close(a.keys, b.keys, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(a.values, b.values, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family,tree", [("llama", "static:medium"), ("gemma3", "dynamic")])
def test_caches_after_each_step_equal_fresh_prefill(family, tree):
    target = loaded(MODELS[family]())
    draft = loaded(MODELS[family](seed=3))
    engine = build_engine(target, "draft", draft=draft, tree=tree, tree_depth=4, backend="hf")
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    committed = list(prompt)
    steps_with_accepts = 0
    for event in engine.stream(prompt, SamplingParams(max_new_tokens=20)):
        committed += event.token_ids
        steps_with_accepts += event.kinds.count("accepted") > 0
        # the target holds everything but the pending last token
        _assert_cache_equals_prefill(engine.runner, target.model, committed[:-1])
        # the draft cache holds the prefix it recorded, compacted from its tree slots
        drafter = engine.drafter
        assert drafter.cached == committed[: len(drafter.cached)]
        _assert_cache_equals_prefill(drafter.runner, draft.model, drafter.cached)
    assert engine.last.stats.tree_steps > 0


def test_model_that_cannot_take_a_mask_gets_a_clear_error_and_chains_still_work():
    model = tiny_llama()
    model.config.layer_types = ["chunked_attention"] * model.config.num_hidden_layers
    target = loaded(model)
    with pytest.raises(UnsupportedModel, match="chunked_attention"):
        build_engine(target, "ngram", tree="static:small", backend="hf")
    chain = build_engine(target, "ngram", backend="hf").generate([1, 2, 3, 1, 2, 3, 1], SamplingParams(max_new_tokens=8))
    assert len(chain.token_ids) == 8
    model.config.layer_types = None
    model.config._attn_implementation_internal = "flash_attention_2"
    with pytest.raises(UnsupportedModel, match="flash_attention_2"):
        tree_mask_plan(model)
