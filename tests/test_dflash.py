"""The DFlash drafter (drafters/dflash.py) on tiny models: greedy output equals plain
decoding (chains and trees, float32 and bfloat16 exact mode, both backends; random drafters, so
exactness cannot lean on drafter quality), the sampled output keeps the target's distribution with the
drafter's q, the training forward equals the drafter at inference over the whole prefix, the training
loss falls, checkpoints round-trip and a drafter for another target is refused."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import distilled_features, feature_drafter, loaded, skip_without_native, tiny_llama
from verispec.drafters.dflash import (DFlashDrafter, DFlashModel, block_logits_for_anchors, load_dflash_model,
                                      position_weights)
from verispec.engine import Engine
from verispec.errors import HeadMismatch
from verispec.heads import save_head
from verispec.train.extract import FeatureSet
from verispec.tree import DynamicTree
from verispec.types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 5, 9, 2], [3], [7, 7, 7, 7, 7, 7, 1, 2, 3, 11, 40, 2]]
N_NEW = 32


def random_drafter_model(target, seed: int = 1, vocab: int | None = None, block_size: int = 5, layers: int = 2,
                         sharp: float = 20.0) -> DFlashModel:
    """A random DFlash drafter over a shuffled draft vocabulary of `vocab` ids (confident when sharp is
    large: long wrong blocks exercise rollback)."""
    torch.manual_seed(seed)
    V = target.vocab_size
    vd = vocab or V
    m = DFlashModel(DFlashModel.make_config(target, vd, block_size=block_size, num_layers=layers))
    m.d2t.copy_(torch.randperm(V)[:vd])
    with torch.no_grad():
        m.lm_head.weight.mul_(sharp)
        m.mask_embed.normal_()
        for layer in m.layers:  # random residual branches (they start at zero for training)
            layer.o.weight.normal_(0, 0.2)
            layer.down.weight.normal_(0, 0.2)
    m.attach_embedding(target.model.get_input_embeddings().weight)
    return m.eval()


@pytest.fixture(scope="module")
def tiny():
    return loaded(tiny_llama(vocab=48, seed=3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["hf", "fast"])
@pytest.mark.parametrize("tree", [None, "dynamic", "static:medium"])
def test_greedy_exact_tiny(dtype, backend, tree):
    """bfloat16 on the fast backend is exact mode (the runner's default for greedy decoding)."""
    target = loaded(tiny_llama(vocab=48, seed=3, dtype=dtype))
    plain = Engine.for_model(target, None, backend=backend)
    drafter = DFlashDrafter(random_drafter_model(target, vocab=24 if backend == "fast" else None), target.vocab_size,
                           weights_dtype=dtype)
    # a fixed budget: the auto budget may decline to draft (it weighs measured times), and this test is about
    # the tree's output, not that choice
    engine = Engine.for_model(target, drafter, draft_length=4, tree=DynamicTree(budget=8) if tree == "dynamic" else tree,
                              backend=backend)
    for prompt in PROMPTS:
        want = plain.generate(prompt, SamplingParams(max_new_tokens=N_NEW)).token_ids
        got = engine.generate(prompt, SamplingParams(max_new_tokens=N_NEW))
        assert got.token_ids == want, (tree, prompt)
        assert got.stats.drafted > 0


@pytest.mark.parametrize("copies", ["none", "bf16", "8-bit"])
def test_the_native_block_forward_computes_the_python_bits(tiny, copies):
    """DFlashModel.blocks at inference as one native call (native.dflash_blocks) against its Python
    operations, the reference: the same block logits and drafts, bit for bit, for every kind of weight copy."""
    skip_without_native(copies)
    model = random_drafter_model(tiny, vocab=24, block_size=5, layers=2)
    ctx = PROMPTS[2]
    feats = torch.randn(len(ctx) - 1, model.fc.in_features)

    def drafts(python: bool):
        d = feature_drafter(DFlashDrafter, model, tiny.vocab_size, ctx, feats, copies, python)
        with torch.no_grad():
            lg = d.block_logits(ctx)
            tree = d.propose_tree(ctx, DynamicTree(budget=8, topk=3, depth=4))
        return lg, tree.tokens.tolist(), tree.parents

    want, got = drafts(True), drafts(False)
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]


def test_an_oracle_block_is_accepted_whole(tiny):
    """A drafter whose block is the target's own greedy continuation gets every draft accepted: the
    block lands at the right positions (an off-by-one would get ~nothing accepted) and the engine takes
    B-1 tokens per forward."""
    want = Engine.for_model(tiny, None, backend="fast").generate(PROMPTS[2], SamplingParams(max_new_tokens=N_NEW)).token_ids
    seq = PROMPTS[2] + want
    drafter = DFlashDrafter(random_drafter_model(tiny), tiny.vocab_size)
    real = drafter.block_logits

    def oracle(context):
        lg = real(context)
        if lg is None:
            return None
        n = len(context)
        out = torch.full_like(lg, -1e4)
        t2d = {int(t): i for i, t in enumerate(drafter.d2t.tolist())}
        for i in range(lg.shape[0]):
            if n + i < len(seq):
                out[i, t2d[seq[n + i]]] = 0.0
        return out

    drafter.block_logits = oracle
    g = Engine.for_model(tiny, drafter, draft_length=4, backend="fast").generate(PROMPTS[2], SamplingParams(max_new_tokens=N_NEW))
    assert g.token_ids == want
    assert g.stats.accepted >= g.stats.drafted - 4 and g.stats.committed / g.stats.steps > 4


def test_sampling_path_is_lossless():
    """Sampled blocks with the drafter's per-position q (a chain, and a static tree drawn without
    replacement) keep the target's distribution: 3 tokens, chi-square against the enumerated target."""
    from conftest import three_token_distribution
    from stats_util import chi_square_pvalue, marginals

    target, exact = three_token_distribution()
    for tree in (None, "static:[[0],[1],[0,0],[1,0]]"):
        drafter = DFlashDrafter(random_drafter_model(target, block_size=3, sharp=0.5), target.vocab_size)
        engine = Engine.for_model(target, drafter, draft_length=2, tree=tree, backend="hf")
        samples, drafted, accepted = [], 0, 0
        for i in range(2500):
            g = engine.generate([1, 2, 3], SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=3, seed=i))
            samples.append(tuple(g.token_ids))
            drafted += g.stats.drafted
            accepted += g.stats.accepted
        assert drafted > 0 and 0 < accepted < drafted  # the rule really ran with both outcomes
        p_joint = chi_square_pvalue(samples, exact)
        p_marg = [chi_square_pvalue(*marginals(samples, exact, i)) for i in range(3)]
        assert p_joint > 1e-3 and min(p_marg) > 1e-3, (tree, p_joint, p_marg)


V = 40


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A tiny target's greedy answers to random prompts and their features (as test_train.py builds)."""
    target = loaded(tiny_llama(vocab=V, seed=11, layers=4))
    records, paths, _ = distilled_features(target, tmp_path_factory.mktemp("feats"))
    return target, records, FeatureSet(paths)


def _trainable(target, records, block_size=5, seed=0):
    from verispec.train.vocab import build_draft_vocab

    torch.manual_seed(seed)
    d2t = build_draft_vocab(records, 32, V)
    m = DFlashModel(DFlashModel.make_config(target, d2t.numel(), block_size=block_size, num_layers=2))
    m.d2t.copy_(d2t)
    with torch.no_grad():
        m.lm_head.weight.copy_(target.model.get_output_embeddings().weight[d2t])
    m.attach_embedding(target.model.get_input_embeddings().weight)
    return m


def test_training_forward_equals_the_drafter(dataset):
    """At every anchor of a sequence (whole prefix from position 0 as keys), the training forward's
    block logits equal what the drafter computes at inference from the features the engine hands it."""
    target, records, data = dataset
    torch.manual_seed(5)
    model = random_drafter_model(target, seed=4, vocab=32, sharp=1.0)
    r = records[2]
    seq = r["prompt_ids"] + r["answer_ids"]
    n, pl = len(seq), len(r["prompt_ids"])
    cols = data.columns(model.feature_layers, model.hidden)
    feats = data.feats_of(2).index_select(-1, cols).float()
    tok = torch.tensor([seq])
    anchors = torch.arange(pl - 2, n - 1)[None]  # pl - 2: the pending token is the last prompt token
    with torch.no_grad():
        train = block_logits_for_anchors(model, tok, feats[None], anchors)[0]
    drafter = DFlashDrafter(model, target.vocab_size)
    drafter.begin(seq[:pl], SamplingParams(), None)
    drafter.observe_features(feats[:pl - 1])
    for c, t in enumerate(anchors[0].tolist()):  # anchor t: committed 0..t, pending token seq[t + 1]
        got = drafter.block_logits(seq[: t + 2])
        torch.testing.assert_close(train[c], got, atol=1e-4, rtol=1e-4)
        drafter.observe_features(feats[t + 1: t + 2])


def test_loss_falls_and_resumes(dataset, tmp_path):
    from verispec.train.loops import train_dflash

    target, records, data = dataset
    model = _trainable(target, records)
    hist = train_dflash(model, data, V, tmp_path / "d", steps=40, batch_size=4, seq_len=24, lr=1e-2, anchors=8,
                        progress=False, log=lambda m: None)
    first = sum(h["loss"] for h in hist[:5]) / 5
    last = sum(h["loss"] for h in hist[-5:]) / 5
    assert last < 0.85 * first, (first, last)
    assert len(hist[0]["top1"]) == model.block_size - 1
    more = train_dflash(_trainable(target, records), data, V, tmp_path / "d", steps=45, batch_size=4, seq_len=24,
                        lr=1e-2, anchors=8, progress=False, log=lambda m: None)
    assert len(more) == 45 and more[:40] == hist  # resumed from the checkpoint, not restarted


def test_position_weights_favour_early_positions():
    w = position_weights(8)
    assert len(w) == 7 and w[0] == 1.0 and all(a > b for a, b in zip(w, w[1:]))


def test_checkpoint_round_trip_and_refusal(dataset, tmp_path):
    target, records, _ = dataset
    model = _trainable(target, records, seed=3)
    with torch.no_grad():
        model.mask_embed.normal_()
    save_head(tmp_path / "d", dict(model.config), model.state_dict(), dtype=torch.float32)
    back = load_dflash_model(target, tmp_path / "d")
    assert json.loads((tmp_path / "d" / "config.json").read_text())["kind"] == "dflash"
    tok = torch.randint(0, V, (1, 12))
    feats = torch.randn(1, 12, len(model.feature_layers) * model.hidden)
    anchors = torch.tensor([[2, 5, 9]])
    with torch.no_grad():
        torch.testing.assert_close(block_logits_for_anchors(model, tok, feats, anchors),
                                   block_logits_for_anchors(back, tok, feats, anchors))
    assert back.d2t.tolist() == model.d2t.tolist()
    save_head(tmp_path / "d16", dict(model.config), model.state_dict())  # bfloat16 storage, as shipped
    load_dflash_model(target, tmp_path / "d16")

    other = loaded(tiny_llama(vocab=V, seed=12, layers=4), name="other")  # same shape, other weights
    with pytest.raises(HeadMismatch, match="trained for 'tiny'") as err:
        load_dflash_model(other, tmp_path / "d")
    assert "\n" not in str(err.value) and "verispec train dflash" in str(err.value)
    with pytest.raises(HeadMismatch, match="not a 'dflash' head"):
        from verispec.drafters.eagle import EagleHead

        e = EagleHead(EagleHead.make_config(target, 32))
        save_head(tmp_path / "e", dict(e.config), e.state_dict())
        load_dflash_model(target, tmp_path / "e")


def test_method_and_cli_refuse_bad_input(tiny):
    from typer.testing import CliRunner

    from verispec.cli import app
    from verispec.drafters import make_drafter

    with pytest.raises(HeadMismatch, match="no dflash head is shipped for 'tiny'"):
        make_drafter("dflash", tiny)
    r = CliRunner().invoke(app, ["train", "dflash", "--block-size", "1"])
    assert r.exit_code == 2 and "block-size must be >= 2" in r.output
    r = CliRunner().invoke(app, ["train", "dflash", "--dflash-layers", "0"])
    assert r.exit_code == 2 and "dflash-layers must be >= 1" in r.output
