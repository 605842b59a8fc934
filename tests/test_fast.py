"""The fast path (verispec.fast): logits equal transformers' for every supported family, the static
cache's crop / compact / tree-mask semantics, exact mode, backend selection, and the engine's greedy
exactness on the fast backend (tiny random models here; the real embedded models in test_fast_real.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import loaded, tiny_gemma3, tiny_llama

from verispec.api import build_engine
from verispec.errors import InvalidParameter, UnsupportedModel
from verispec.backends import TreeMask, make_runner
from verispec.backends.fast import FastRunner
from verispec.backends.transformers import HFRunner
from verispec.fast import attend, supports
from verispec.types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_qwen3(vocab: int = 32, seed: int = 0, dtype=torch.float32):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
                      eos_token_id=None, bos_token_id=0, pad_token_id=0)
    model = Qwen3ForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        for layer in model.model.layers:  # non-trivial q/k norm weights, so a missing norm shows
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return model


def tiny_qwen2(vocab: int = 32, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
                      eos_token_id=None, bos_token_id=0, pad_token_id=0)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # biases start at zero; make them matter
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.uniform_(-0.5, 0.5)
        model.lm_head.weight.mul_(8.0)
    return model


def tiny_mistral(vocab: int = 32, seed: int = 0, window: int = 6):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    cfg = MistralConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=512, sliding_window=window,
                        tie_word_embeddings=False, eos_token_id=None, bos_token_id=0, pad_token_id=0)
    model = MistralForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def tiny_gemma3_capped(seed: int = 0):
    """Final logit soft-capping on; attention soft-capping set too, which transformers ignores for Gemma 3."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, max_position_embeddings=512, sliding_window=5,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           attn_logit_softcapping=2.0, final_logit_softcapping=3.0, query_pre_attn_scalar=12,
                           eos_token_id=None, bos_token_id=0, pad_token_id=0, attn_implementation="eager")
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(4.0)
        for layer in model.model.layers:  # Gemma norms start at zero (weight 1 + 0); make them matter
            for norm in (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                         layer.post_feedforward_layernorm, layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.uniform_(-0.5, 0.5)
    return model


FAMILIES = {"llama": tiny_llama, "qwen3": tiny_qwen3, "qwen2": tiny_qwen2, "mistral_window": tiny_mistral,
            "gemma3": tiny_gemma3, "gemma3_softcap": tiny_gemma3_capped}


def _reference(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids[None]).logits[0].float()


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("exact", [False, True])
def test_logits_match_transformers(family, exact):
    model = FAMILIES[family]()
    assert supports(model)
    torch.manual_seed(1)
    ids = torch.randint(0, 32, (40,))  # longer than every sliding window above
    ref = _reference(model, ids)
    runner = FastRunner(model, capacity=64, exact=exact, exact_bucket=4, exact_max_rows=4)
    last = runner.forward(ids[:17], last_only=True).logits  # prefill
    assert last.shape == (1, 32)
    steps = [runner.forward(ids[17:18]).logits, runner.forward(ids[18:27]).logits, runner.forward(ids[27:]).logits]  # 9 > bucket: chunked
    got = torch.cat([last] + steps)
    torch.testing.assert_close(got, ref[16:], atol=2e-5, rtol=1e-4)
    assert runner.length == 40


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_logits_match_transformers_bfloat16(family):
    model = FAMILIES[family]().to(torch.bfloat16)
    ids = torch.randint(0, 32, (30,), generator=torch.Generator().manual_seed(2))
    ref = _reference(model, ids)
    runner = FastRunner(model, capacity=64, exact=False)
    runner.forward(ids[:10], last_only=True)
    got = torch.cat([runner.forward(ids[10:11]).logits, runner.forward(ids[11:]).logits])
    # bfloat16 keeps ~3 significant digits; logits here are O(10)
    torch.testing.assert_close(got, ref[10:], atol=0.15, rtol=0.02)
    assert (got.argmax(-1) == ref[10:].argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("family", ["llama", "gemma3", "mistral_window"])
def test_crop_then_new_tokens_equal_a_fresh_run(family):
    model = FAMILIES[family]()
    ids = torch.randint(0, 32, (24,), generator=torch.Generator().manual_seed(3))
    other = torch.randint(0, 32, (8,), generator=torch.Generator().manual_seed(4))
    runner = FastRunner(model, capacity=64, exact=False)
    runner.forward(ids)
    runner.rollback(14)
    assert runner.length == 14
    got = runner.forward(other).logits
    ref = _reference(model, torch.cat([ids[:14], other]))[14:]
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    runner.rollback(100)  # cropping past the end keeps everything
    assert runner.length == 22
    runner.reset()
    assert runner.length == 0
    torch.testing.assert_close(runner.forward(ids[:5]).logits, _reference(model, ids[:5]), atol=2e-5, rtol=1e-4)


def _tree():
    """root 0 with children 1, 2; node 1 has children 3, 4; node 3 has child 5; node 2 has child 6."""
    parents = [-1, 0, 0, 1, 1, 3, 2]
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    depths = torch.zeros(n, dtype=torch.long)
    for i, p in enumerate(parents):
        anc[i, i] = True
        j = p
        while j >= 0:
            anc[i, j] = True
            depths[i] += 1
            j = parents[j]
    return parents, anc, depths


def _path(parents, node):
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "mistral_window"])
@pytest.mark.parametrize("exact", [False, True])
def test_tree_logits_equal_each_path_alone_and_compact(family, exact):
    model = FAMILIES[family]()
    prefix = torch.randint(0, 32, (9,), generator=torch.Generator().manual_seed(5))
    parents, anc, depths = _tree()
    tokens = torch.tensor([7, 3, 11, 5, 30, 2, 19])
    runner = FastRunner(model, capacity=64, exact=exact, exact_bucket=4, exact_max_rows=4)  # 7 nodes > bucket: chunked tree
    runner.forward(prefix, last_only=True)
    logits = runner.forward(tokens, tree=TreeMask(anc, depths)).logits
    assert logits.shape == (7, 32) and runner.length == 16
    for leaf in (4, 5, 6):
        path = _path(parents, leaf)
        ref = _reference(model, torch.cat([prefix, tokens[path]]))[len(prefix):]
        torch.testing.assert_close(logits[path], ref, atol=2e-5, rtol=1e-4)
    # keep the path 0 -> 1 -> 3 -> 5, then continue: equal to having decoded that chain
    runner.commit(9, [0, 1, 3, 5])
    assert runner.length == 13
    nxt = torch.tensor([4, 8])
    got = runner.forward(nxt).logits
    ref = _reference(model, torch.cat([prefix, tokens[[0, 1, 3, 5]], nxt]))[-2:]
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_compact_after_the_cache_grew():
    """A forward that grows the cache (inside inference mode) leaves inference tensors; compacting a tree
    path afterwards, from outside inference mode as the engine does, must still work."""
    model = tiny_llama()
    runner = FastRunner(model, capacity=1500, exact=False, kv_block=16)
    small = runner.allocated
    ids = torch.randint(0, 32, (small + 8,), generator=torch.Generator().manual_seed(3)).tolist()
    runner.forward(ids, last_only=True)
    assert runner.allocated > small  # it grew
    base = runner.length
    runner.forward(ids[:4])
    keys = [k[:, base + 2].clone() for k in runner.k]
    runner.commit(base, [0, 2])
    assert runner.length == base + 2
    assert all(torch.equal(k[:, base + 1], want) for k, want in zip(runner.k, keys))


def test_tree_start_grows_a_tree_over_several_calls():
    """A drafter feeding a tree depth by depth (tree_start) gets the logits of the whole-tree call."""
    model = tiny_llama()
    prefix = torch.randint(0, 32, (6,), generator=torch.Generator().manual_seed(6))
    parents, anc, depths = _tree()
    tokens = torch.tensor([7, 3, 11, 5, 30, 2, 19])
    whole = FastRunner(model, capacity=64, exact=False)
    whole.forward(prefix, last_only=True)
    ref = whole.forward(tokens, tree=TreeMask(anc, depths)).logits
    grown = FastRunner(model, capacity=64, exact=False)
    grown.forward(prefix, last_only=True)
    start = grown.length
    part1 = grown.forward(tokens[:3], tree=TreeMask(anc[:3, :3], depths[:3])).logits
    part2 = grown.forward(tokens[3:], tree=TreeMask(anc[3:], depths, start)).logits
    torch.testing.assert_close(torch.cat([part1, part2]), ref, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError):
        grown.forward(tokens[:2], tree=TreeMask(anc[:2, :3], depths[:3]))


def test_hf_and_fast_runner_agree_on_trees():
    model = tiny_gemma3()
    prefix = torch.randint(0, 32, (12,), generator=torch.Generator().manual_seed(7))
    parents, anc, depths = _tree()
    tokens = torch.tensor([1, 2, 3, 4, 5, 6, 7])
    out = []
    for runner in (HFRunner(model), FastRunner(model, capacity=64)):
        runner.forward(prefix, last_only=True)
        out.append(runner.forward(tokens, tree=TreeMask(anc, depths)).logits.float())
    torch.testing.assert_close(out[1], out[0], atol=2e-5, rtol=1e-4)


@pytest.fixture(params=["kernel", "ops"])
def exact_attention(request, monkeypatch):
    """Run a test on attend.py's kernel (where it builds) and on canonical.py's PyTorch operations."""
    if request.param == "ops":
        monkeypatch.setattr(attend, "runs_on", lambda t: False)
    elif attend.available() is not None:
        pytest.skip(f"attention kernel: {attend.available()}")
    return request.param


def test_exact_mode_logits_do_not_depend_on_how_tokens_share_a_pass(exact_attention):
    """The property exact mode exists for: a position's logits are bit-identical whether it is scored
    alone or together with other tokens (here in bfloat16, where rounding differs most)."""
    for dtype in (torch.bfloat16, torch.float32):
        model = tiny_llama(layers=3, hidden=64).to(dtype)
        ids = torch.randint(0, 32, (60,), generator=torch.Generator().manual_seed(8))
        # kv_block 16: the passes attend over different lengths L (16, 32, ...) for the same positions
        one = FastRunner(model, capacity=128, exact=True, exact_bucket=8, kv_block=16)
        one.forward(ids[:10], last_only=True)
        alone = torch.cat([one.forward(ids[i:i + 1]).logits for i in range(10, 60)])
        many = FastRunner(model, capacity=128, exact=True, exact_bucket=8, kv_block=16)
        many.forward(ids[:10], last_only=True)
        together = torch.cat([many.forward(ids[a:b]).logits for a, b in ((10, 13), (13, 20), (20, 21), (21, 37), (37, 60))])
        assert torch.equal(alone, together), dtype


@pytest.mark.parametrize("kv_block", [16, 64, 512])
def test_exact_mode_is_right_when_a_pass_ends_on_the_attended_length(kv_block, exact_attention):
    """Canonical attention sums a row's last TAIL columns; where the attended length L is short of them
    (small kv blocks), the columns past L must add nothing: they once repeated column L - 1, which a
    pass's last row sees when the pass ends on L (kv_block 64, 3-token passes: logits off by 2 from
    position 62 on)."""
    model = tiny_llama(layers=2, hidden=64)
    ids = torch.randint(0, 32, (80,), generator=torch.Generator().manual_seed(1))
    ref = _reference(model, ids)
    runner = FastRunner(model, capacity=200, exact=True, kv_block=kv_block)
    runner.forward(ids[:1], last_only=True)
    got = torch.cat([runner.forward(ids[i:i + 3]).logits for i in range(1, 79, 3)])
    torch.testing.assert_close(got, ref[1:79], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_mode_holds_across_attention_block_boundaries(dtype):
    """Positions 740-800 scored alone and in passes of 6: the passes that start before slot 760 attend
    over fewer slots (L) than the same positions alone. With the default kv_block (512) that is exact;
    kv_block 256 broke it in float32 (30 of 60 positions differed), as it did on SmolLM2 in bfloat16."""
    model = tiny_llama(layers=2, hidden=64).to(dtype)
    ids = torch.randint(0, 32, (800,), generator=torch.Generator().manual_seed(8))
    runs = []
    for cuts in ([*range(740, 801)], [*range(740, 800, 6), 800]):
        runner = FastRunner(model, capacity=1400, exact=True, exact_bucket=8)
        runner.forward(ids[:740], last_only=True)
        runs.append(torch.cat([runner.forward(ids[a:b]).logits for a, b in zip(cuts, cuts[1:])]))
    assert torch.equal(runs[0], runs[1])


def test_capacity_is_enforced_and_prepare_follows_greedy():
    from verispec.errors import InvalidPrompt

    runner = FastRunner(tiny_llama(), capacity=16)
    runner.forward(list(range(10)))
    with pytest.raises(InvalidPrompt):
        runner.forward(list(range(7)))
    runner.reset(SamplingParams(temperature=0.8))
    assert runner.mode.exact is False
    runner.reset(SamplingParams())
    assert runner.mode.exact is True
    fixed = FastRunner(tiny_llama(), capacity=16, exact=False)
    fixed.reset(SamplingParams())
    assert fixed.mode.exact is False


def test_backend_selection():
    llama = loaded(tiny_llama())
    assert isinstance(build_engine(llama, "ar").runner, FastRunner)
    assert isinstance(build_engine(llama, "ar", backend="hf").runner, HFRunner)
    assert isinstance(build_engine(llama, "ar", backend="fast").runner, FastRunner)
    with pytest.raises(InvalidParameter):
        build_engine(llama, "ar", backend="tpu")
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    assert not supports(gpt2)
    assert isinstance(make_runner(gpt2, "auto"), HFRunner)
    with pytest.raises(UnsupportedModel):
        make_runner(gpt2, "fast")


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3"])
def test_engine_greedy_speculation_equals_plain_decoding_on_fast_backend(family):
    target = loaded(FAMILIES[family](), name=family)
    draft = loaded(FAMILIES[family](seed=1), name=family + "-draft")
    params = SamplingParams(max_new_tokens=40)
    prompts = [[1, 2, 3, 4, 1, 2, 3], [5, 9, 5, 9, 5, 9, 17], [30, 1, 22]]
    for prompt in prompts:
        plain_hf = build_engine(target, "ar", backend="hf").generate(prompt, params).token_ids
        plain = build_engine(target, "ar", backend="fast").generate(prompt, params).token_ids
        assert plain == plain_hf
        for method, opts in (("ngram", {}), ("draft", {"draft": draft}), ("draft", {"draft": draft, "draft_length": 3})):
            engine = build_engine(target, method, backend="fast", **opts)
            assert isinstance(engine.runner, FastRunner)
            assert engine.generate(prompt, params).token_ids == plain, (method, opts)
        if method == "draft":
            assert isinstance(engine.drafter.runner, FastRunner)  # the draft runs on the fast path too


def test_engine_sampling_on_fast_backend_is_reproducible_and_uses_fast_mode():
    target = loaded(tiny_llama())
    params = SamplingParams(temperature=1.0, seed=3, max_new_tokens=30)
    engine = build_engine(target, "ngram", backend="fast")
    a = engine.generate([1, 2, 3, 1, 2, 3], params).token_ids
    assert engine.runner.mode.exact is False  # exact mode is for greedy only, unless asked for
    b = build_engine(target, "ngram", backend="fast").generate([1, 2, 3, 1, 2, 3], params).token_ids
    assert a == b and len(a) == 30 and all(0 <= t < 32 for t in a)


def test_compiled_step_matches_eager():
    """torch.compile (inductor on CPU) for the verify/decode passes: same logits as eager, one graph
    per bucket shared by all layers."""
    model = tiny_llama()
    ids = torch.randint(0, 32, (14,), generator=torch.Generator().manual_seed(9))
    eager = FastRunner(model, capacity=32, exact=False)
    comp = FastRunner(model, capacity=32, exact=False, compile=True, buckets=(4,))
    for r in (eager, comp):
        r.forward(ids[:8], last_only=True)
    a = torch.cat([eager.forward(ids[8:11]).logits, eager.forward(ids[11:14]).logits])
    b = torch.cat([comp.forward(ids[8:11]).logits, comp.forward(ids[11:14]).logits])
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def _random_tree(n: int, seed: int):
    """A random tree of n nodes in topological order: parents, ancestor mask, depths."""
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    anc = torch.zeros(n, n, dtype=torch.bool)
    depths = torch.zeros(n, dtype=torch.long)
    for i in range(n):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
        depths[i] = int(anc[i].sum()) - 1
    return parents, anc, depths


@pytest.mark.parametrize("family", ["llama", "gemma3", "mistral_window"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_mode_tree_logits_are_bit_identical_to_chains(family, dtype, exact_attention):
    """Exact mode's layout-free attention (fast/canonical.py, attend.py's kernel or PyTorch's operations):
    every tree node's logits are the bits the
    same tokens get as a plain chain, though its ancestors sit at other cache slots; so is the step
    after compacting a path. Prefixes put the trees across 64-position cuts and past the first one.
    Without it (PassMode canonical False: fused SDPA over the tree slots) the float32 cases fail here
    (in bfloat16 the tiny models' activations round the difference away; SmolLM2's did not)."""
    model = FAMILIES[family]().to(dtype)
    for prefix_len, n, seed in ((150, 20, 1), (187, 24, 2), (40, 12, 3)):
        gen = torch.Generator().manual_seed(seed)
        prefix = torch.randint(0, 32, (prefix_len,), generator=gen)
        tokens = torch.randint(0, 32, (n,), generator=gen)
        parents, anc, depths = _random_tree(n, seed)
        runner = FastRunner(model, capacity=512, exact=True)
        runner.forward(prefix, last_only=True)
        tree = runner.forward(tokens, tree=TreeMask(anc, depths)).logits
        leaves = [i for i in range(n) if i not in parents]
        for leaf in leaves:
            path = _path(parents, leaf)
            chain = FastRunner(model, capacity=512, exact=True)
            chain.forward(prefix, last_only=True)
            assert torch.equal(tree[path], chain.forward(tokens[path]).logits), (family, dtype, prefix_len, leaf)
        path = _path(parents, leaves[-1])
        runner.commit(prefix_len, path)
        chain = FastRunner(model, capacity=512, exact=True)
        chain.forward(prefix, last_only=True)
        chain.forward(tokens[path])  # the path's keys from an exact pass, as plain decoding makes them
        nxt = torch.tensor([3, 9, 4])
        assert torch.equal(runner.forward(nxt).logits, chain.forward(nxt).logits)
