"""EAGLE and Medusa drafters: exactness against plain greedy decoding (random heads on tiny models:
exactness must not depend on head quality), the sampling path, and head checkpoints."""

from __future__ import annotations

import pytest
import torch

from conftest import feature_drafter, loaded, skip_without_8bit, skip_without_native, tiny_gemma3, tiny_llama
from verispec.drafters.base import Drafter
from verispec.drafters.eagle import EagleDrafter, EagleHead
from verispec.drafters.medusa import MedusaDrafter, MedusaHeads
from verispec.engine import Engine
from verispec.tree import DynamicTree
from verispec.types import SamplingParams


pytestmark = pytest.mark.usefixtures("one_thread")


def random_eagle(target, seed: int = 1, vocab: int | None = None, layers: int = 1) -> EagleHead:
    """A randomly initialised EAGLE head with a draft vocabulary of the first `vocab` ids, shuffled."""
    torch.manual_seed(seed)
    V = target.vocab_size
    vd = vocab or V
    head = EagleHead(EagleHead.make_config(target, vd, num_layers=layers))
    head.d2t.copy_(torch.randperm(V)[:vd])
    with torch.no_grad():
        head.lm_head.weight.mul_(20.0)  # confident random drafts: long wrong chains exercise rollback
    head.attach_embedding(target.model.get_input_embeddings().weight)
    return head.eval()


def random_medusa(target, seed: int = 1, heads: int = 3, vocab: int | None = None) -> MedusaHeads:
    """Random Medusa heads (blocks far from zero, so the heads disagree with the target)."""
    torch.manual_seed(seed)
    V = target.vocab_size
    vd = vocab or V
    m = MedusaHeads(MedusaHeads.make_config(target, vd, heads))
    m.d2t.copy_(torch.randperm(V)[:vd])
    m.init_lm_head(target.model.get_output_embeddings().weight)
    with torch.no_grad():
        for block in m.blocks:
            block.weight.normal_(0, 0.5)
    return m.eval()


def make_drafter(kind: str, target, **kw):
    if kind == "eagle":
        kw.pop("heads", None)
        return EagleDrafter(random_eagle(target, **kw), target.vocab_size)
    return MedusaDrafter(random_medusa(target, **kw), target.vocab_size)


PROMPTS = [[1, 5, 9, 2], [3], [7, 7, 7, 7, 7, 7, 1, 2, 3, 11, 40, 2]]
N_NEW = 32


@pytest.fixture(scope="module")
def tiny():
    return loaded(tiny_llama(vocab=48, seed=3))


@pytest.fixture(scope="module")
def plain_outputs(tiny):
    return {backend: [Engine.for_model(tiny, None, backend=backend).generate(p, SamplingParams(max_new_tokens=N_NEW)).token_ids
                      for p in PROMPTS] for backend in ("hf", "fast")}


@pytest.mark.parametrize("backend", ["hf", "fast"])
@pytest.mark.parametrize("kind", ["eagle", "medusa"])
@pytest.mark.parametrize("tree", [None, "dynamic", "static:medium"])
def test_greedy_exact_tiny(kind, tree, backend, tiny, plain_outputs):
    # a reduced draft vocabulary (tokens outside it are never drafted) on one backend, the full one on the other
    drafter = make_drafter(kind, tiny, vocab=24 if backend == "fast" else None)
    # a fixed budget: the auto budget may decline to draft (it weighs measured times), and this test is about
    # the tree's output, not that choice
    engine = Engine.for_model(tiny, drafter, draft_length=4, tree=DynamicTree(budget=8) if tree == "dynamic" else tree,
                              backend=backend)
    for prompt, want in zip(PROMPTS, plain_outputs[backend]):
        got = engine.generate(prompt, SamplingParams(max_new_tokens=N_NEW))
        assert got.token_ids == want, (kind, tree, prompt)
        assert got.stats.drafted > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_eagle_head_drafts_like_its_parameters(tiny, plain_outputs, dtype):
    """Drafting with packed weight copies (EagleHead.pack_for_inference): the head's outputs stay those
    of its parameters (to the dtype's rounding), its state dict gains nothing, and output stays exact."""
    head = random_eagle(tiny, vocab=24)
    x = torch.randn(5, head.fc.in_features)
    ids = torch.tensor([1, 4, 9, 2, 7])
    pos = torch.arange(5)

    def run():
        with torch.no_grad():
            h = head.inputs(ids, head.project(x))
            q, k, v = head.qkv(h, pos)
            att = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(q.shape[0] // k.shape[0], 0),
                                                                   v.repeat_interleave(q.shape[0] // v.shape[0], 0))
            return head.logits(head.finish(h, att))

    keys = set(head.state_dict())
    want = run()
    drafter = EagleDrafter(head, tiny.vocab_size, weights_dtype=dtype)
    assert head._packed is not None or dtype == torch.float32
    got = run()
    tol = 1e-4 if dtype == torch.float32 else 0.05 * float(want.abs().max())
    assert torch.allclose(got, want, atol=tol, rtol=0), float((got - want).abs().max())
    assert set(head.state_dict()) == keys
    engine = Engine.for_model(tiny, drafter, draft_length=4, tree="dynamic", backend="fast")
    for prompt, expect in zip(PROMPTS, plain_outputs["fast"]):
        assert engine.generate(prompt, SamplingParams(max_new_tokens=N_NEW)).token_ids == expect


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_deeper_eagle_head_drafts_exactly(tiny, plain_outputs, dtype):
    """An EAGLE head with layers after the first (--head-layers): each layer runs from its own packed copies
    and its own cache; what it drafts (chains and trees) changes with the later layers, the drafts stay
    those of its parameters to the dtype's rounding, and the output equals plain decoding's."""
    import copy

    deep = random_eagle(tiny, vocab=24, layers=3)
    assert len(deep.layers) == 2
    shallow = copy.deepcopy(deep)
    shallow.layers = torch.nn.ModuleList()
    shallow.num_layers = 1
    ctx = PROMPTS[2]
    feats = torch.randn(len(ctx) - 1, deep.fc.in_features)

    def drafts(head, weights_dtype):
        d = EagleDrafter(head, tiny.vocab_size, weights_dtype=weights_dtype)
        d.begin(ctx, SamplingParams(), None)
        d.observe_features(feats)
        with torch.no_grad():
            return d.head.logits(d.sync(ctx)), d.propose(ctx, 4).tokens.tolist()

    want, chain = drafts(copy.deepcopy(deep), None)
    other, _ = drafts(shallow, None)
    assert not torch.allclose(want, other, atol=1e-3)  # the later layers take part
    got, _ = drafts(copy.deepcopy(deep), dtype)
    tol = 1e-4 if dtype == torch.float32 else 0.05 * float(want.abs().max())
    assert torch.allclose(got, want, atol=tol, rtol=0), float((got - want).abs().max())
    packed = EagleDrafter(deep, tiny.vocab_size, weights_dtype=dtype)
    assert dtype == torch.float32 or ("layers.1.q", "layers.1.k", "layers.1.v") in deep._packed
    for tree in (None, DynamicTree(budget=8)):
        engine = Engine.for_model(tiny, packed, draft_length=4, tree=tree, backend="fast")
        for prompt, expect in zip(PROMPTS, plain_outputs["fast"]):
            got = engine.generate(prompt, SamplingParams(max_new_tokens=N_NEW))
            assert got.token_ids == expect, (tree, prompt)
            assert got.stats.drafted > 0


@pytest.mark.parametrize("quantized", [False, True])
def test_stacked_copies_compute_what_each_linear_does(tiny, quantized):
    """q/k/v and gate/up run through one stacked packed copy each (PackedLinears.lins): the same outputs as
    the separate copies (8-bit: the same bits, a scale per output channel and the activations' groups per
    row; bf16: to the matmul's summation order), split to each layer's width; without copies each layer."""
    if quantized:
        skip_without_8bit()
    head = random_eagle(tiny, vocab=24)
    x = torch.randn(3, head.hidden)
    want = [head.get_submodule(n)(x) for n in ("q", "k", "v")]
    assert all(torch.equal(a, b) for a, b in zip(head.lins(("q", "k", "v"), x), want))  # no copies: the layers
    head.pack_for_inference(torch.bfloat16, quantized)
    assert ("q", "k", "v") in head._packed and ("gate", "up") in head._packed
    for names in (("q", "k", "v"), ("gate", "up")):
        got, each = head.lins(names, x), [head.lin(n, x) for n in names]
        assert [t.shape for t in got] == [t.shape for t in each] == [(3, head.get_submodule(n).out_features) for n in names]
        for a, b in zip(got, each):
            assert torch.equal(a, b) if quantized else torch.allclose(a, b, atol=1e-2 * float(b.abs().max()), rtol=0)


def test_head_norm_runs_the_kernel_when_drafting_and_the_operations_when_training(monkeypatch):
    """RMSNorm of the heads: under no_grad the norm.py kernel (same arithmetic, the sum in its own order), with
    gradients the operations autograd differentiates; both agree to float32 rounding."""
    from verispec.drafters.head_parts import RMSNorm
    from verispec.fast import norm

    calls = []
    real = norm.rms_norm
    monkeypatch.setattr(norm, "rms_norm", lambda *a: calls.append(1) or real(*a))
    n = RMSNorm(40)
    with torch.no_grad():
        n.weight.copy_(torch.rand(40) + 0.5)
    x = torch.randn(2, 5, 40)
    with torch.no_grad():
        fast = n(x)
    assert len(calls) == (norm.available() is None)
    slow = n(x.requires_grad_())
    assert len(calls) == (norm.available() is None) and slow.requires_grad and torch.allclose(fast, slow.detach(), atol=1e-6, rtol=1e-5)
    slow.sum().backward()
    assert x.grad is not None and n.weight.grad is not None


def test_eagle_dynamic_tree_pruning_keeps_the_same_tree(tiny):
    """Stopping the expansion once no deeper node can enter the budget changes the work, not the tree."""
    torch.manual_seed(0)
    fed = {}
    for seed, budget in ((1, 1), (5, 2), (1, 3), (2, 5), (3, 7), (4, 12)):
        head = random_eagle(tiny, seed=seed)
        with torch.no_grad():
            head.lm_head.weight.mul_(0.05)  # flat drafts: weak frontiers, where pruning stops early
        trees = []
        for prune in (True, False):
            d = EagleDrafter(head, tiny.vocab_size)
            d.prune = prune
            engine = Engine.for_model(tiny, d, backend="fast", tree=DynamicTree(budget=budget, topk=3, depth=5))
            shapes = []
            real, real_feed = d.propose_tree, d.feed
            fed[budget, prune] = 0

            def spy(context, shape, real=real, shapes=shapes):
                p = real(context, shape)
                shapes.append((p.tokens.tolist(), list(p.parents)) if p is not None else None)
                return p

            def feed(cands, nodes, real_feed=real_feed, key=(budget, prune)):
                fed[key] += 1
                return real_feed(cands, nodes)

            d.propose_tree, d.feed = spy, feed
            engine.generate(PROMPTS[2], SamplingParams(max_new_tokens=12))
            trees.append(shapes)
        assert trees[0] == trees[1] and trees[0], (seed, budget)
        assert fed[budget, True] <= fed[budget, False], (budget, fed)
    # budget 1: the best first-level node holds the budget, so no level is drafted past it
    assert fed[1, True] == 0 < fed[1, False], fed


def test_greedy_exact_gemma3_eagle():
    target = loaded(tiny_gemma3(vocab=40, seed=2))
    for kind in ("eagle", "medusa"):
        engine = Engine.for_model(target, make_drafter(kind, target), draft_length=3, tree="dynamic")
        for prompt in PROMPTS[:2]:
            want = Engine.for_model(target, None).generate(prompt, SamplingParams(max_new_tokens=24)).token_ids
            assert engine.generate(prompt, SamplingParams(max_new_tokens=24)).token_ids == want


class _Spy(Drafter):
    """Wraps a feature-reading drafter and records the features the engine hands it."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name
        self.can_tree, self.feature_layers = inner.can_tree, inner.feature_layers
        self.got = []

    def begin(self, *a):
        self.got = []
        self.inner.begin(*a)

    def observe_features(self, f):
        self.got.append(f.clone())
        self.inner.observe_features(f)

    def propose(self, *a):
        return self.inner.propose(*a)

    def propose_tree(self, *a):
        return self.inner.propose_tree(*a)

    def observe(self, r):
        self.inner.observe(r)


@pytest.mark.parametrize("backend", ["hf", "fast"])
@pytest.mark.parametrize("tree", [None, "dynamic"])
def test_engine_hands_over_the_committed_positions_features(tiny, backend, tree):
    """After every step the drafter holds exactly the target's hidden states of the committed positions
    (all of the context but the pending token), as a plain forward over them computes."""
    spy = _Spy(make_drafter("eagle", tiny, vocab=24))
    engine = Engine.for_model(tiny, spy, draft_length=3, tree=tree, backend=backend)
    prompt = PROMPTS[2]
    out = engine.generate(prompt, SamplingParams(max_new_tokens=20))
    got = torch.cat(spy.got)
    seq = prompt + out.token_ids
    assert got.shape[0] == len(seq) - 1  # every committed position but the last (pending) token
    with torch.no_grad():
        hs = tiny.model(input_ids=torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states
    want = torch.cat([hs[i][0] for i in spy.feature_layers], -1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_sampling_path_is_lossless():
    """Sampled proposals with draft probabilities (EAGLE chain, Medusa static tree drawn without
    replacement) keep the target's distribution: 3 tokens, chi-square against the enumerated target."""
    from conftest import three_token_distribution
    from stats_util import chi_square_pvalue, marginals

    target, exact = three_token_distribution()
    cases = [("eagle", None, 2), ("medusa", "static:[[0],[1],[0,0],[1,0]]", 2)]
    for kind, tree, k in cases:
        drafter = make_drafter(kind, target, heads=2) if kind == "medusa" else make_drafter(kind, target)
        if kind == "eagle":
            with torch.no_grad():
                drafter.head.lm_head.weight.mul_(0.05)  # a soft q: several tokens drafted
        engine = Engine.for_model(target, drafter, draft_length=k, tree=tree, backend="hf")
        samples, drafted, accepted = [], 0, 0
        for i in range(2500):
            g = engine.generate([1, 2, 3], SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=3, seed=i))
            samples.append(tuple(g.token_ids))
            drafted += g.stats.drafted
            accepted += g.stats.accepted
        assert drafted > 0 and 0 < accepted < drafted  # the rule really ran with both outcomes
        p_joint = chi_square_pvalue(samples, exact)
        p_marg = [chi_square_pvalue(*marginals(samples, exact, i)) for i in range(3)]
        assert p_joint > 1e-3 and min(p_marg) > 1e-3, (kind, p_joint, p_marg)


@pytest.mark.parametrize("quantized", [False, True])
def test_medusa_heads_draft_from_packed_copies(tiny, plain_outputs, quantized):
    """Medusa's linears run from packed copies as the EAGLE head's do (8-bit for a quantized target): the
    blocks from one stacked copy (they all read h), their biases added after; the logits stay the
    parameters' to the copies' rounding, the state dict gains nothing, and the output equals plain decoding."""
    import copy

    if quantized:
        skip_without_8bit()
    heads = random_medusa(tiny, heads=3, vocab=24)
    with torch.no_grad():
        for block in heads.blocks:
            block.bias.normal_(0, 0.5)
    no_bias = copy.deepcopy(heads)
    with torch.no_grad():
        for block in no_bias.blocks:
            block.bias.zero_()
    h = torch.randn(2, int(tiny.model.config.hidden_size))
    keys = set(heads.state_dict())
    with torch.no_grad():
        want, without = heads(h), no_bias(h)
    drafter = MedusaDrafter(heads, tiny.vocab_size, weights_dtype=torch.bfloat16, quantized=quantized)
    assert ("blocks.0", "blocks.1", "blocks.2") in heads._packed
    assert not quantized or {type(w).__name__ for w, *_ in heads._packed.values()} <= {"QWeight", "Int8"}
    with torch.no_grad():
        got = heads(h)
    tol = 0.05 * float(want.abs().max())
    assert not torch.equal(got, want) and torch.allclose(got, want, atol=tol, rtol=0), float((got - want).abs().max())
    assert float((got - without).abs().max()) > tol  # the biases are applied
    assert set(heads.state_dict()) == keys
    for tree in (None, "static:[[0],[1],[0,0],[1,0]]"):
        engine = Engine.for_model(tiny, drafter, draft_length=3, tree=tree, backend="fast")
        for prompt, expect in zip(PROMPTS, plain_outputs["fast"]):
            got_ids = engine.generate(prompt, SamplingParams(max_new_tokens=N_NEW))
            assert got_ids.token_ids == expect and got_ids.stats.drafted > 0, (tree, prompt)


@pytest.mark.parametrize("layout,layers", [("verispec", 1), ("eagle3", 1), ("eagle3", 2)])
@pytest.mark.parametrize("copies", ["none", "bf16", "8-bit"])
def test_the_native_eagle_step_computes_the_python_bits(tiny, layout, layers, copies):
    """EagleDrafter._run as one native call (native.eagle_run) against its Python operations, the reference:
    the same head outputs, cache entries, chains and trees, bit for bit, for both layouts, later layers and
    every kind of weight copy; with VERISPEC_NATIVE=0 or no compiler the Python operations run."""
    skip_without_native(copies)
    torch.manual_seed(3)
    head = EagleHead(EagleHead.make_config(tiny, 24, layout=layout, num_layers=layers))
    head.d2t.copy_(torch.randperm(tiny.vocab_size)[:24])
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))  # norms away from 1, later layers not the identity
    head.attach_embedding(tiny.model.get_input_embeddings().weight)
    ctx = PROMPTS[2]
    feats = torch.randn(len(ctx) - 1, head.fc.in_features)

    def drafts(python: bool):
        d = feature_drafter(EagleDrafter, head, tiny.vocab_size, ctx, feats, copies, python)
        with torch.no_grad():
            h = d.sync(ctx)
            chain = d.propose(ctx, 4).tokens.tolist()
            tree = d.propose_tree(ctx, DynamicTree(budget=8, topk=3, depth=4))
        return h, d.K[:, :, : d.scratch].clone(), chain, tree.tokens.tolist(), tree.parents

    want, got = drafts(True), drafts(False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2:] == want[2:]


def test_a_quantized_targets_head_drafts_with_8_bit_weights(tiny, plain_outputs):
    """For a target on quantized weights the head's linears run 8-bit (pack_for_inference(quantized=True)):
    its logits stay within the 8-bit rounding of its parameters' ones, its state dict gains nothing, and
    the output stays exact; the drafter built for such a target asks for it."""
    from verispec.fast import quant

    skip_without_8bit()
    head = random_eagle(tiny, vocab=24)
    x = torch.randn(5, head.fc.in_features)
    ids = torch.tensor([1, 4, 9, 2, 7])

    def run():
        with torch.no_grad():
            h = head.inputs(ids, head.project(x))
            return head.logits(h)

    keys = set(head.state_dict())
    want = run()
    drafter = EagleDrafter(head, tiny.vocab_size, weights_dtype=torch.bfloat16, quantized=True)
    kinds = {type(w).__name__ for w, *_ in head._packed.values()}
    assert kinds <= {"QWeight", "Int8"} and kinds, kinds
    got = run()
    assert not torch.equal(got, want)  # other weights than the parameters ...
    assert torch.allclose(got, want, atol=0.05 * float(want.abs().max()), rtol=0)  # ... within 8 bits' error
    assert set(head.state_dict()) == keys
    engine = Engine.for_model(tiny, drafter, draft_length=4, tree="dynamic", backend="fast")
    for prompt, expect in zip(PROMPTS, plain_outputs["fast"]):
        assert engine.generate(prompt, SamplingParams(max_new_tokens=N_NEW)).token_ids == expect

    class Target:  # what for_target reads: a bf16 model from a quantized file, weights auto
        dtype, device, weights, weight_source = torch.bfloat16, torch.device("cpu"), "auto", object()

    assert (quant.target_format(Target()) != "bf16") == (quant.default_format() != "bf16")
    Target.weights = "q8"
    assert quant.target_format(Target()) == "q8"
    Target.weights, Target.weight_source = "auto", None
    assert quant.target_format(Target()) == "bf16"  # a dense model runs its dense weights
