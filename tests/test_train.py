"""Training pipeline pieces on tiny models: features, a few steps with a falling loss, the training-time
test matching inference, checkpoint round trip, refusal of a head for another target, and the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import distilled_features, loaded, tiny_llama
from verispec.drafters.eagle import EagleDrafter, EagleHead, default_feature_layers, load_eagle_head
from verispec.drafters.medusa import MedusaHeads, load_medusa_heads
from verispec.engine import Engine
from verispec.errors import HeadMismatch
from verispec.heads import save_head
from verispec.train.extract import FeatureSet, extract_features
from verispec.train.loops import eagle_unroll, train_eagle, train_medusa
from verispec.train.vocab import build_draft_vocab
from verispec.types import SamplingParams

V = 40


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    return loaded(tiny_llama(vocab=V, seed=11, layers=4))


@pytest.fixture(scope="module")
def dataset(tiny, tmp_path_factory):
    """Self-distilled records (the tiny target's greedy answers to random prompts) and their features."""
    records, paths, layers = distilled_features(tiny, tmp_path_factory.mktemp("feats"))
    return records, FeatureSet(paths), layers


def _eagle(tiny, records, vocab=32, seed=0, layout="verispec", layers=1):
    torch.manual_seed(seed)
    d2t = build_draft_vocab(records, vocab, V)
    head = EagleHead(EagleHead.make_config(tiny, d2t.numel(), layout=layout, num_layers=layers))
    head.d2t.copy_(d2t)
    head.attach_embedding(tiny.model.get_input_embeddings().weight)
    return head


def test_features_match_a_plain_forward(tiny, dataset):
    records, data, layers = dataset
    assert len(data) == len(records)
    seq = records[3]["prompt_ids"] + records[3]["answer_ids"]
    out = tiny.model(input_ids=torch.tensor([seq]), output_hidden_states=True)
    o = data.offsets[3]
    want = torch.cat([out.hidden_states[i][0] for i in layers], -1)
    torch.testing.assert_close(data.feats_of(3).float(), want, atol=0.05, rtol=0.02)  # stored in bf16
    assert data.topk_ids[o:o + len(seq), 0].tolist() == out.logits[0].argmax(-1).tolist()


def test_fast_backend_features_match_transformers(tiny, dataset, tmp_path):
    """The feature pass on verispec's own forward stores what the transformers pass stores (within the
    bf16 rounding of the stored features), and a shard made by the other backend or from the target in
    another dtype is redone, not reused."""
    records, data, layers = dataset
    paths = extract_features(tiny, records[:5], tmp_path, layers, shard_size=5, progress=False, backend="fast")
    fast = FeatureSet(paths)
    n = fast.num_tokens
    assert fast.tokens.tolist() == data.tokens[:n].tolist()
    torch.testing.assert_close(torch.cat([fast.feats_of(i) for i in range(len(fast))]).float(),
                               torch.cat([data.feats_of(i) for i in range(len(fast))]).float(), atol=0.05, rtol=0.02)
    assert fast.topk_ids[:, 0].tolist() == data.topk_ids[:n, 0].tolist()
    torch.testing.assert_close(fast.topk_p, data.topk_p[:n], atol=2e-3, rtol=2e-3)
    assert torch.load(paths[0])["backend"] == "fast"
    extract_features(tiny, records[:5], tmp_path, layers, shard_size=5, progress=False, backend="hf")
    assert torch.load(paths[0])["backend"] == "hf" and torch.load(paths[0])["dtype"] == "float32"
    half = loaded(tiny_llama(vocab=V, seed=11, layers=4).to(torch.bfloat16))  # the same target in another dtype
    extract_features(half, records[:5], tmp_path, layers, shard_size=5, progress=False, backend="hf")
    assert torch.load(paths[0])["dtype"] == "bfloat16"  # redone, not reused
    with pytest.raises(ValueError, match="unknown feature backend"):
        extract_features(tiny, records[:5], tmp_path, layers, progress=False, backend="jax")


@pytest.mark.parametrize("layout,precision", [("verispec", "float32"), ("verispec", "bfloat16"), ("eagle3", "bfloat16")])
def test_eagle_loss_falls(tiny, dataset, tmp_path, layout, precision):
    records, data, _ = dataset
    head = _eagle(tiny, records, layout=layout)
    hist = train_eagle(head, data, V, tmp_path / "w", steps=40, batch_size=4, seq_len=32, lr=3e-3, ttt_steps=3,
                       log=lambda m: None, progress=False, autocast=precision)
    assert all(p.dtype == torch.float32 for p in head.parameters())  # autocast keeps float32 master weights
    first, last = sum(h["loss"] for h in hist[:5]) / 5, sum(h["loss"] for h in hist[-5:]) / 5
    assert last < 0.85 * first, (first, last)
    assert len(hist[-1]["top1"]) == 3


def test_medusa_loss_falls(tiny, dataset, tmp_path):
    records, data, _ = dataset
    d2t = build_draft_vocab(records, 32, V)
    m = MedusaHeads(MedusaHeads.make_config(tiny, d2t.numel(), 2))
    m.d2t.copy_(d2t)
    m.init_lm_head(tiny.model.get_output_embeddings().weight)
    hist = train_medusa(m, data, V, tmp_path / "m", steps=40, batch_size=4, seq_len=32, lr=1e-2, log=lambda m: None,
                        progress=False)
    first, last = sum(h["loss"] for h in hist[:5]) / 5, sum(h["loss"] for h in hist[-5:]) / 5
    assert last < 0.85 * first, (first, last)


def test_training_resumes_from_its_checkpoint(tiny, dataset, tmp_path):
    records, data, _ = dataset
    kw = dict(steps=12, batch_size=2, seq_len=16, save_every=5, progress=False)
    full = train_eagle(_eagle(tiny, records, seed=1), data, V, tmp_path / "a", log=lambda m: None, **kw)

    def crash(message):  # the first log line comes at step 10, after the checkpoint of step 5
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_eagle(_eagle(tiny, records, seed=1), data, V, tmp_path / "b", log=crash, **kw)
    lines = []
    part = train_eagle(_eagle(tiny, records, seed=1), data, V, tmp_path / "b", log=lines.append, **kw)
    assert lines[0] == "resumed at step 5"
    assert [h["loss"] for h in part] == pytest.approx([h["loss"] for h in full], rel=1e-4)


def test_a_resumed_training_counts_the_time_before_it(tiny, dataset, tmp_path):
    """--max-minutes is the training time in all: a run resumed after its budget was spent trains no more
    steps (before, each resumed run got the whole budget again and restarted the schedule's clock)."""
    records, data, _ = dataset
    kw = dict(steps=12, batch_size=2, seq_len=16, save_every=5, progress=False)

    def crash(message):  # the first log line comes at step 10, after the checkpoint of step 5
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_eagle(_eagle(tiny, records, seed=1), data, V, tmp_path, log=crash, **kw)
    state = torch.load(tmp_path / "trainer.pt", weights_only=False)
    state["history"][-1]["seconds"] = 60.0  # the first run trained for a minute
    torch.save(state, tmp_path / "trainer.pt")
    lines = []
    spent = train_eagle(_eagle(tiny, records, seed=1), data, V, tmp_path, log=lines.append, max_seconds=30, **kw)
    assert lines == ["resumed at step 5", "time budget already spent at step 5"] and len(spent) == 5
    more = train_eagle(_eagle(tiny, records, seed=1), data, V, tmp_path, log=lambda m: None, max_seconds=3600, **kw)
    assert len(more) == 12 and more[-1]["seconds"] >= 60.0  # a larger budget trains on, on the same clock


@torch.inference_mode()
@pytest.mark.parametrize("layout,layers", [("verispec", 1), ("eagle3", 1), ("eagle3", 3)])
def test_training_time_test_matches_inference(tiny, dataset, layout, layers):
    """The unrolled training forward computes what the drafter computes when it drafts a chain (also with
    layers after the first, each with its own cache)."""
    records, data, _ = dataset
    head = _eagle(tiny, records, layout=layout, layers=layers).eval()
    seq = records[5]["prompt_ids"] + records[5]["answer_ids"]
    out = tiny.model(input_ids=torch.tensor([seq]), output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i] for i in head.feature_layers], -1)
    outs = eagle_unroll(head, torch.tensor([seq]), feats, 3)
    N = 12  # the drafter's context: seq[:N], features of seq[:N-1]
    d = EagleDrafter(head, V)
    d.begin(seq[:N], SamplingParams(), None)
    d.observe_features(feats[0, : N - 1])
    h1 = d.sync(seq[:N])
    torch.testing.assert_close(head.logits(h1), outs[0][0, N - 2], atol=1e-4, rtol=1e-4)
    d.scratch = d.n
    h2 = d._expand([seq[N]], h1[None], 1, [[]])[0]
    torch.testing.assert_close(head.logits(h2), outs[1][0, N - 2], atol=1e-4, rtol=1e-4)
    h3 = d._expand([seq[N + 1]], h2[None], 2, [[d.n]])[0]
    torch.testing.assert_close(head.logits(h3), outs[2][0, N - 2], atol=1e-4, rtol=1e-4)


def _drafter_logits(head, seq, feats, t, steps):
    """What EagleDrafter computes at anchor t (context seq[:t + 2], target features of positions <= t),
    drafting a chain of the true next tokens: logits of draft steps 1..steps."""
    d = EagleDrafter(head, V)
    d.begin(seq[: t + 2], SamplingParams(), None)
    d.observe_features(feats[: t + 1])
    h = d.sync(seq[: t + 2])
    d.scratch = d.n
    out, slots = [head.logits(h)], []
    for depth in range(1, steps):
        h = d._expand([seq[t + 1 + depth]], h[None], depth, [list(slots)])[0]
        slots.append(d.scratch - 1)
        out.append(head.logits(h))
    return out


@torch.inference_mode()
@pytest.mark.parametrize("head_layers", [1, 2])
def test_training_windows_see_the_whole_prefix(tiny, tmp_path, head_layers):
    """A training window deep into a long sequence computes, at every anchor and unrolled step, what the
    drafter computes there at inference, where the head's cache holds every position from 0 (the
    windows of old started 16 tokens before the answer and failed this)."""
    g = torch.Generator().manual_seed(5)
    plain = Engine.for_model(tiny, None, backend="hf")
    records = []
    for i in range(3):
        prompt = torch.randint(1, V, (40 + 7 * i,), generator=g).tolist()
        ans = plain.generate(prompt, SamplingParams(max_new_tokens=30)).token_ids
        records.append({"id": str(i), "source": "test", "prompt_ids": prompt, "answer_ids": ans})
    L = tiny.model.config.num_hidden_layers
    layers = sorted(set(default_feature_layers(L)) | {L})
    data = FeatureSet(extract_features(tiny, records, tmp_path, layers, progress=False))
    head = _eagle(tiny, records, layers=head_layers).eval()
    cols = data.columns(head.feature_layers, 32)
    steps = 6
    batch = data.batch([0, 1, 2], seq_len=8, rng=torch.Generator().manual_seed(1))
    assert (batch["anchors"][:, 0] >= 38).all()  # the windows sit after the prompts
    feats = batch["feats"].index_select(-1, cols).float()
    outs = eagle_unroll(head, batch["tokens"], feats, steps, batch["anchors"])
    checked = 0
    for r in range(3):
        seq = batch["tokens"][r].tolist()
        for c in range(batch["anchors"].shape[1]):
            t = int(batch["anchors"][r, c])
            if not batch["anchor_mask"][r, c] or t + steps >= len(seq) or seq[t + steps] == 0:
                continue
            want = _drafter_logits(head, seq, feats[r], t, steps)
            for j in range(steps):
                torch.testing.assert_close(outs[j][r, c], want[j], atol=1e-4, rtol=1e-4)
            checked += 1
    assert checked >= 10


def test_checkpoint_round_trip_and_refusal(tiny, dataset, tmp_path):
    records, _, _ = dataset
    head = _eagle(tiny, records, seed=3)
    cfg = dict(head.config)
    save_head(tmp_path / "eagle", cfg, head.state_dict(), dtype=torch.float32)
    back = load_eagle_head(tiny, tmp_path / "eagle")
    assert json.loads((tmp_path / "eagle" / "config.json").read_text())["target"]["name"] == "tiny"
    x = torch.randn(5, len(head.feature_layers) * 32)
    ids = torch.tensor([1, 2, 3, 4, 5])
    with torch.no_grad():
        g1, g2 = head.inputs(ids, head.project(x)), back.inputs(ids, back.project(x))
        torch.testing.assert_close(g1, g2)
        torch.testing.assert_close(head.logits(g1), back.logits(g2))
    assert back.d2t.tolist() == head.d2t.tolist()
    # bfloat16 storage (as shipped) loads too
    save_head(tmp_path / "eagle16", cfg, head.state_dict())
    load_eagle_head(tiny, tmp_path / "eagle16")

    other = loaded(tiny_llama(vocab=V, seed=12, layers=4), name="other")  # same shape, other weights
    with pytest.raises(HeadMismatch, match="trained for 'tiny'"):
        load_eagle_head(other, tmp_path / "eagle")
    wider = loaded(tiny_llama(vocab=V + 8, seed=11, layers=4), name="wider")
    with pytest.raises(HeadMismatch, match="vocab_size"):
        load_eagle_head(wider, tmp_path / "eagle")
    with pytest.raises(HeadMismatch, match="not a 'medusa' head"):
        load_medusa_heads(tiny, tmp_path / "eagle")
    with pytest.raises(HeadMismatch, match="not a head folder"):
        load_eagle_head(tiny, tmp_path / "nowhere")

    m = MedusaHeads(MedusaHeads.make_config(tiny, 32, 2))
    save_head(tmp_path / "medusa", dict(m.config), m.state_dict(), dtype=torch.float32)
    mb = load_medusa_heads(tiny, tmp_path / "medusa")
    h = torch.randn(3, 32)
    torch.testing.assert_close(m(h), mb(h))
    with pytest.raises(HeadMismatch):
        load_medusa_heads(other, tmp_path / "medusa")


def test_training_starts_from_a_trained_head_of_the_same_shape_only(tiny, dataset, tmp_path):
    """--init: the head being trained takes a saved head's weights (as stored, bfloat16), and a head with
    another draft vocabulary or other sizes is refused with a message, not half loaded."""
    from verispec.errors import InvalidParameter
    from verispec.train.pipeline import start_from

    records, _, _ = dataset
    saved = _eagle(tiny, records, seed=1)
    save_head(tmp_path / "a", dict(saved.config), saved.state_dict())
    head = _eagle(tiny, records, seed=2)
    start_from(head, tmp_path / "a", saved.d2t, tiny)
    for name, want in saved.state_dict().items():
        got = head.state_dict()[name]
        assert torch.equal(got, want.to(torch.bfloat16).float() if want.is_floating_point() else want), name
    with pytest.raises(InvalidParameter, match="another vocabulary"):
        start_from(head, tmp_path / "a", saved.d2t.flip(0), tiny)
    wide = EagleHead(EagleHead.make_config(tiny, saved.d2t.numel(), intermediate_size=48))
    with pytest.raises(InvalidParameter, match="does not fit"):
        start_from(wide, tmp_path / "a", saved.d2t, tiny)
    other = EagleHead(EagleHead.make_config(tiny, saved.d2t.numel(), feature_layers=[2, 1]))  # same shapes, other columns
    assert other.feature_layers != saved.feature_layers
    with pytest.raises(InvalidParameter, match="reads the target's hidden states"):
        start_from(other, tmp_path / "a", saved.d2t, tiny)


@torch.inference_mode()
def test_a_deeper_head_grows_from_a_trained_one(tiny, dataset, tmp_path):
    """--init with --head-layers above the saved head's: the first layer takes the saved weights, the new
    layers start as identity, so the grown head drafts exactly what the saved one drafted (and training
    moves on from there); a saved head deeper than the one being trained is refused."""
    from verispec.errors import InvalidParameter
    from verispec.train.pipeline import start_from

    records, data, _ = dataset
    saved = _eagle(tiny, records, seed=1, layout="eagle3")
    save_head(tmp_path / "a", dict(saved.config), saved.state_dict(), dtype=torch.float32)
    grown = _eagle(tiny, records, seed=2, layout="eagle3", layers=3)
    start_from(grown, tmp_path / "a", saved.d2t, tiny)
    assert grown.layers[1].q.weight.abs().sum() > 0  # the new layers keep their random attention ...
    batch = data.batch([0, 1], seq_len=8, rng=torch.Generator().manual_seed(0))
    cols = data.columns(saved.feature_layers, 32)
    feats = batch["feats"].index_select(-1, cols).float()
    want = eagle_unroll(saved.eval(), batch["tokens"], feats, 3, batch["anchors"])
    got = eagle_unroll(grown.eval(), batch["tokens"], feats, 3, batch["anchors"])
    for a, b in zip(got, want):  # ... but add nothing to the residual: the saved head's logits
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    save_head(tmp_path / "deep", dict(grown.config), grown.state_dict(), dtype=torch.float32)
    with pytest.raises(InvalidParameter, match="does not fit"):
        start_from(_eagle(tiny, records, layout="eagle3", layers=2), tmp_path / "deep", saved.d2t, tiny)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_teacher_forced_drafts_every_answer_position_against_the_targets_own_logits(tiny, dataset, kind):
    """evaluate.teacher_forced (head_ceiling.py, top1_by_step): the target's logits over the whole sequence
    are a plain forward's (their argmax is the greedy answer), anchors run from the last prompt token, each
    step gives logits over the head's draft vocabulary, and top1_by_step counts what those logits agree on."""
    from verispec.train.evaluate import teacher_forced, top1_by_step

    records, _, _ = dataset
    if kind == "eagle":
        module = _eagle(tiny, records).eval()
    else:
        module = MedusaHeads(MedusaHeads.make_config(tiny, 32, 3))
        module.d2t.copy_(build_draft_vocab(records, 32, V))
        module.init_lm_head(tiny.model.get_output_embeddings().weight)
    seqs = [(r["prompt_ids"], r["answer_ids"]) for r in records[:3]]
    got = list(teacher_forced(tiny, kind, module, seqs, steps=3))
    assert len(got) == 3
    counts = [[0, 0] for _ in range(3)]
    for (prompt, answer), (tok, logits, anchors, drafts) in zip(seqs, got):
        n, pl = len(prompt) + len(answer), len(prompt)
        assert tok.tolist() == prompt + answer
        with torch.no_grad():
            want = tiny.model(input_ids=tok[None]).logits[0]
        torch.testing.assert_close(logits.float(), want.float(), atol=1e-3, rtol=1e-3)
        assert logits[pl - 1: n - 1].argmax(-1).tolist() == answer[: n - pl]  # the answers are greedy
        assert anchors.tolist() == list(range(pl - 1, n - 1)) and len(drafts) == 3
        assert all(d.shape == (n - pl, module.d2t.numel()) for d in drafts)
        for j, d in enumerate(drafts, start=1):
            ok = anchors + j + 1 < n
            counts[j - 1][0] += int(((module.d2t[d.argmax(-1)] == tok[(anchors + j + 1).clamp_max(n - 1)]) & ok).sum())
            counts[j - 1][1] += int(ok.sum())
    assert top1_by_step(tiny, kind, module, seqs, steps=3) == counts


def test_no_shipped_head_for_a_tiny_model(tiny):
    from verispec.drafters import make_drafter

    with pytest.raises(HeadMismatch, match="no eagle head is shipped"):
        make_drafter("eagle", tiny)
    with pytest.raises(HeadMismatch, match="no medusa head is shipped"):
        make_drafter("medusa", tiny)


def test_cli_rejects_bad_options():
    from typer.testing import CliRunner

    from verispec.cli import app

    r = CliRunner().invoke(app, ["train", "eagle", "--steps", "0"])
    assert r.exit_code == 2 and "steps must be >= 1" in r.output
    r = CliRunner().invoke(app, ["train", "medusa", "--lr", "-1"])
    assert r.exit_code == 2 and "lr must be > 0" in r.output
    r = CliRunner().invoke(app, ["train", "eagle", "--feature-backend", "jax"])
    assert r.exit_code == 2 and "unknown feature backend 'jax'" in r.output
    r = CliRunner().invoke(app, ["train", "eagle", "--train-precision", "fp8"])
    assert r.exit_code == 2 and "unknown train precision 'fp8'" in r.output
    r = CliRunner().invoke(app, ["train", "eagle", "--gen-minutes", "-1"])
    assert r.exit_code == 2 and "gen-minutes must be >= 0" in r.output
    r = CliRunner().invoke(app, ["train", "dflash", "--head-intermediate", "64"])
    assert r.exit_code == 2 and "a dflash head does not take it" in r.output
    r = CliRunner().invoke(app, ["train", "eagle", "--head-intermediate", "0"])
    assert r.exit_code == 2 and "head-intermediate must be >= 1" in r.output
    r = CliRunner().invoke(app, ["train", "eagle", "--head-layers", "0"])
    assert r.exit_code == 2 and "head-layers must be >= 1" in r.output
    r = CliRunner().invoke(app, ["train", "medusa", "--head-layers", "2"])
    assert r.exit_code == 2 and "a medusa head does not take it" in r.output
    r = CliRunner().invoke(app, ["train", "eagle", "--init", "/no/such/head"])
    assert r.exit_code == 2 and "init: no head folder at '/no/such/head'" in r.output
    for bad in ("3,x", "3,3", "0,16", ","):
        r = CliRunner().invoke(app, ["train", "eagle", "--feature-layers", bad])
        assert r.exit_code == 2 and "feature-layers takes distinct hidden-state indices" in r.output, bad
    r = CliRunner().invoke(app, ["train", "medusa", "--feature-layers", "3,16,30"])
    assert r.exit_code == 2 and "Medusa heads read the final hidden state" in r.output


def test_feature_layers_are_checked_against_the_target():
    from verispec.errors import InvalidParameter
    from verispec.train.pipeline import TrainConfig, feature_layers_for

    assert feature_layers_for(TrainConfig(), 30) is None  # the head's default
    assert feature_layers_for(TrainConfig(feature_layers="3,16,30"), 30) == [3, 16, 30]
    with pytest.raises(InvalidParameter, match="hidden states 1..30, not 31"):
        feature_layers_for(TrainConfig(feature_layers="3,31"), 30)


def test_learning_rate_anneals_by_the_step_count_or_the_time_budget(tmp_path):
    from verispec.train.loops import Trainer

    tr = Trainer.__new__(Trainer)
    tr.lr, tr.steps = 1.0, 100
    assert tr.lr_at(0) == pytest.approx(0.2) and tr.lr_at(4) == pytest.approx(1.0)  # warm-up: 5 steps
    assert tr.lr_at(52) == pytest.approx(0.5, abs=0.02) and tr.lr_at(99) < 1e-3
    assert tr.lr_at(10, time_share=0.5) == pytest.approx(0.5, abs=0.01)  # half the time budget used
    assert tr.lr_at(10, time_share=1.0) == pytest.approx(0.0, abs=1e-9)
    assert tr.lr_at(90, time_share=0.1) == pytest.approx(tr.lr_at(90))  # the steps run out first


def test_heldout_split_is_per_source_and_stable():
    from verispec.train.data import split_heldout

    records = [{"id": f"{s}-{i}", "source": s} for s, n in (("a", 100), ("b", 41), ("c", 3)) for i in range(n)]
    train, held = split_heldout(records, 0.05)
    assert {r["id"] for r in train}.isdisjoint(r["id"] for r in held) and len(train) + len(held) == len(records)
    for s, n in (("a", 100), ("b", 41), ("c", 3)):
        assert sum(r["source"] == s for r in held) >= 0.05 * n  # every source, at least its share
    again = split_heldout(list(reversed(records)), 0.05)[1]
    assert sorted(r["id"] for r in again) == sorted(r["id"] for r in held)  # order does not matter
    more = records + [{"id": f"a-{i}", "source": "a"} for i in range(100, 200)]
    kept = {r["id"] for r in split_heldout(more, 0.05)[1]}
    assert len(kept & {r["id"] for r in held if r["source"] == "a"}) >= 3  # a larger run keeps most of it


def test_training_prompts_mix_sources_and_never_read_the_heldout_slice(tmp_path):
    """On a data folder laid out like ../shared/data (made here): the fixed shares, the prefix property,
    and no prompt (or long-context passage) from the held-out slice."""
    from verispec.train.data import heldout_prompts, training_prompts

    def conv(text):
        return {"conversations": [{"from": "human", "value": text}]}

    (tmp_path / "sharegpt").mkdir()
    (tmp_path / "gsm8k").mkdir()
    sg500 = [f"question {i} " + ("long passage words. " * 40 if i % 3 == 0 else "short") for i in range(300)]
    sg90 = [f"other {i} " + ("more passage text. " * 50 if i % 2 == 0 else "brief") for i in range(400)]
    (tmp_path / "sharegpt" / "ShareGPT_V3_filtered_500.json").write_text(json.dumps([conv(t) for t in sg500]))
    (tmp_path / "sharegpt" / "sg_90k_part1_html_cleaned_lang_first_sampled_sorted.json").write_text(
        json.dumps([conv(t) for t in sg90]))
    (tmp_path / "gsm8k" / "train.jsonl").write_text("\n".join(json.dumps({"question": f"gsm {i}?"}) for i in range(500)))
    prompts = training_prompts(tmp_path, 400)
    counts = {s: sum(p["source"] == s for p in prompts) for s in ("sharegpt", "gsm8k", "longctx")}
    assert abs(counts["gsm8k"] - 120) <= 1 and abs(counts["longctx"] - 60) <= 1 and abs(counts["sharegpt"] - 220) <= 2
    assert all(p["text"].startswith("gsm") for p in prompts if p["source"] == "gsm8k")
    assert training_prompts(tmp_path, 100) == prompts[:100]  # a larger run starts with a smaller run's prompts
    held = heldout_prompts(tmp_path)
    assert held == [t.strip() for t in sg500[-40:]]
    assert not any(h in p["text"] for p in prompts for h in held)


def test_draft_vocabulary_is_rebuilt_when_the_records_change(tmp_path):
    from verispec.train.vocab import draft_vocab_for

    a = [{"id": "1", "prompt_ids": [1], "answer_ids": [5, 5, 5, 6]}]
    b = a + [{"id": "2", "prompt_ids": [1], "answer_ids": [7, 7, 7, 7, 7]}]
    d_a, f_a = draft_vocab_for(tmp_path / "v.pt", a, 2, 10)
    assert d_a.tolist() == [5, 6]
    assert draft_vocab_for(tmp_path / "v.pt", a, 2, 10)[1] == f_a  # same records: the saved one
    d_b, f_b = draft_vocab_for(tmp_path / "v.pt", b, 2, 10)
    assert f_b != f_a and d_b.tolist() == [7, 5]


@pytest.mark.parametrize("decoder", ["engine", "compact"])
def test_batched_self_distillation_equals_one_at_a_time(tiny, tmp_path, monkeypatch, decoder):
    """Answers generated many per batch are the answers generated one by one, float32: bit for bit on
    verispec's engine (exact mode, continuous batching: 10 prompts through 5 places); on transformers
    (left-padded batches) except where the target's top two logits are a near-tie at the first difference."""
    from verispec.train.data import generate_answers

    monkeypatch.setattr(tiny, "encode", lambda prompt=None, chat=None: [int(t) for t in chat.split()])
    g = torch.Generator().manual_seed(3)
    prompts = [{"id": str(i), "source": "test",
                "text": " ".join(map(str, torch.randint(1, V, (int(torch.randint(2, 20, (1,), generator=g)),), generator=g).tolist()))}
               for i in range(10)]
    kw = dict(max_new_tokens=24, log=lambda m: None, progress=False, decoder=decoder)
    batched = {r["id"]: r for r in generate_answers(tiny, prompts, tmp_path / "b.jsonl", batch_size=5, **kw)}
    single = {r["id"]: r for r in generate_answers(tiny, prompts, tmp_path / "s.jsonl", batch_size=1, **kw)}
    assert sorted(batched) == sorted(single) == [str(i) for i in range(10)]
    same = _same_but_near_ties(tiny, single, batched)
    assert same == 10 if decoder == "engine" else same >= 8


def _same_but_near_ties(target, ref: dict, got: dict) -> int:
    """How many of got's answers equal ref's; where one differs, the target's top two logits at the first
    difference are a near-tie (float32 sums in another order may pick either)."""
    same = 0
    for i, r in ref.items():
        a, b = r["answer_ids"], got[i]["answer_ids"]
        if a == b:
            same += 1
            continue
        k = next(j for j in range(min(len(a), len(b))) if a[j] != b[j])
        logits = target.model(input_ids=torch.tensor([r["prompt_ids"] + a[:k]])).logits[0, -1]
        top = logits.topk(2).values
        assert float(top[0] - top[1]) < 1e-4, (i, k, a, b)
    return same


def test_self_distillation_time_budget_resumes(tiny, tmp_path, monkeypatch):
    """--gen-minutes 0 starts no batch (training uses the answers so far); a later run without a budget
    generates only the missing prompts."""
    from verispec.train.data import generate_answers

    monkeypatch.setattr(tiny, "encode", lambda prompt=None, chat=None: [int(t) for t in chat.split()])
    prompts = [{"id": str(i), "source": "test", "text": f"{i + 1} {i + 2} 3"} for i in range(6)]
    kw = dict(max_new_tokens=4, log=lambda m: None, progress=False, batch_size=2)
    out = tmp_path / "a.jsonl"
    assert generate_answers(tiny, prompts[:2], out, **kw) and len(generate_answers(tiny, prompts, out, max_seconds=0, **kw)) == 2
    done = generate_answers(tiny, prompts, out, **kw)
    assert sorted(r["id"] for r in done) == [str(i) for i in range(6)]
    from verispec.errors import InvalidParameter

    with pytest.raises(InvalidParameter, match="unknown decoder 'beam'; use one of auto, engine"):
        generate_answers(tiny, prompts, out, decoder="beam", **kw)


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="mallopt thresholds exist only in glibc's allocator (musl, macOS: nothing to set)")
def test_training_returns_freed_memory_to_the_system():
    """glibc takes the fixed mmap/trim thresholds (the training process grew until killed without them)."""
    from verispec.train.pipeline import return_freed_memory

    assert return_freed_memory()


def test_labels_end_where_an_answer_starts_looping(tiny, tmp_path):
    """--loop-ngram: an answer that falls into a repetition loop gives labels (and anchors) only before the
    loop starts; the tokens of the loop stay out of training; a loop-free answer keeps them all."""
    from verispec.train.extract import loop_free_length

    assert loop_free_length([1, 2, 3, 4, 5], 2) == 5
    assert loop_free_length([1, 2, 3, 1, 2, 3, 1, 2], 3) == 3  # the second "1 2 3" starts at 3
    assert loop_free_length([7, 7, 7, 7], 2) == 1
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(1, V, (10,), generator=g).tolist()
    fresh = torch.randint(1, V, (12,), generator=g).tolist()
    looped = {"id": "loop", "source": "test", "prompt_ids": prompt, "answer_ids": fresh + [5, 6, 7, 8] * 6}
    clean = {"id": "clean", "source": "test", "prompt_ids": prompt, "answer_ids": list(range(1, 31))}
    L = tiny.model.config.num_hidden_layers
    paths = extract_features(tiny, [looped, clean], tmp_path, sorted(set(default_feature_layers(L)) | {L}), progress=False)
    cut = loop_free_length(looped["answer_ids"], 4)
    assert cut == 16
    data = FeatureSet(paths, loop_ngram=4)
    assert data.ends == [10 + cut, 10 + 30]
    assert FeatureSet(paths).ends == data.lengths
    for seed in range(5):
        b = data.batch([0, 1], seq_len=64, rng=torch.Generator().manual_seed(seed))
        labelled = b["label_mask"][0].nonzero().flatten()
        assert labelled.max() + 1 < 10 + cut and labelled.min() + 1 >= 10  # label t is token t + 1
        assert int(b["anchors"][0][b["anchor_mask"][0]].max()) + 2 <= 10 + cut
        assert int(b["label_mask"][1].sum()) == 30  # the clean answer: every answer token a label


def test_self_distillation_stops_an_answer_at_its_first_loop(monkeypatch, tmp_path):
    """With loop_ngram n a row stops once its last n tokens occurred earlier in its answer: the answer is
    the uncut answer up to the end of its first repeated n-gram (so training labels end where they did),
    an answer without a loop is unchanged, EOS still ends an answer, and every record says how it ended.
    The compacting decoder gives transformers' generate's answers (with the LoopStop criterion, and
    without it as the uncut reference), and a row leaves its batch at the step it ends."""
    from verispec.train.data import LoopStop, generate_answers, read_jsonl
    from verispec.train.extract import loop_free_length

    eos = 7
    target = loaded(tiny_llama(vocab=V, seed=5, layers=4, eos=eos), eos=eos)
    monkeypatch.setattr(target, "encode", lambda prompt=None, chat=None: [int(t) for t in chat.split()])
    g = torch.Generator().manual_seed(3)
    prompts = [{"id": str(i), "source": "test",
                "text": " ".join(map(str, torch.randint(1, V, (int(torch.randint(2, 20, (1,), generator=g)),), generator=g).tolist()))}
               for i in range(12)]
    n, cap = 6, 20
    kw = dict(max_new_tokens=cap, log=lambda m: None, progress=False, batch_size=4)
    off = {r["id"]: r for r in generate_answers(target, prompts, tmp_path / "off.jsonl", decoder="generate", **kw)}
    rows_per_forward = []
    hook = target.model.register_forward_pre_hook(lambda m, a, k: rows_per_forward.append(k["input_ids"].shape[0]),
                                                  with_kwargs=True)
    on = {r["id"]: r for r in generate_answers(target, prompts, tmp_path / "on.jsonl", loop_ngram=n, decoder="compact", **kw)}
    hook.remove()
    assert sorted(on) == sorted(off) == sorted(p["id"] for p in prompts)
    ends = {"eos": 0, "loop": 0, "length": 0}
    for i, r in on.items():
        full = off[i]["answer_ids"]
        ends[r["end"]] += 1
        body = full[:-1] if off[i]["end"] == "eos" else full
        start = loop_free_length(body, n)
        if start < len(body):  # looped: cut right after the repeated n-gram, labels still end at `start`
            assert r["end"] == "loop" and r["answer_ids"] == full[: start + n] and len(r["answer_ids"]) < len(full)
            assert loop_free_length(r["answer_ids"], n) == start
            assert r["answer_ids"][start: start + n] in [r["answer_ids"][k: k + n] for k in range(start)]
        else:
            assert r["answer_ids"] == full and r["end"] == off[i]["end"]
        if r["end"] == "eos":
            assert r["answer_ids"][-1] == eos and eos not in r["answer_ids"][:-1]
        elif r["end"] == "length":
            assert len(r["answer_ids"]) == cap and eos not in r["answer_ids"]
    assert min(ends.values()) >= 1, ends  # every way of ending occurs
    assert {r["end"] for r in off.values()} <= {"eos", "length"}
    # each batch: a prefill of all its rows, then decode step k runs exactly the rows longer than k tokens
    lengths = [len(r["answer_ids"]) for r in read_jsonl(tmp_path / "on.jsonl")]  # in batch order
    expect = []
    for b in range(0, len(lengths), 4):
        part = lengths[b:b + 4]
        expect += [len(part)] + [sum(x > k for x in part) for k in range(1, max(part))]
    assert rows_per_forward == expect
    # transformers' generate with the LoopStop criterion: the same answers; a batch stops once all its rows
    # ended, and one row alone stops at the very token that completes its repeated n-gram
    widths = []
    generate = target.model.generate

    def counted(**args):
        out = generate(**args)
        widths.append(out.shape[1] - args["input_ids"].shape[1])
        return out

    monkeypatch.setattr(target.model, "generate", counted)
    ref = generate_answers(target, prompts, tmp_path / "ref.jsonl", loop_ngram=n, decoder="generate", **kw)
    assert {r["id"]: (r["answer_ids"], r["end"]) for r in ref} == {i: (r["answer_ids"], r["end"]) for i, r in on.items()}
    assert len(widths) == 3 and min(widths) < cap
    widths.clear()
    one = generate_answers(target, prompts, tmp_path / "one.jsonl", loop_ngram=n, decoder="generate", **{**kw, "batch_size": 1})
    assert {r["id"]: r["answer_ids"] for r in one} == {i: r["answer_ids"] for i, r in on.items()}
    assert sorted(widths) == sorted(len(r["answer_ids"]) for r in one)
    # verispec's own engine (continuous batching on the fast path): the same answers and ends, one
    # forward per step for every sequence, and a place freed by an ended answer is taken at once
    forwards = []
    from verispec.backends import fast as fast_backend

    real = fast_backend.FastRunner.forward_together
    monkeypatch.setattr(fast_backend.FastRunner, "forward_together",
                        staticmethod(lambda runners, calls: forwards.append(len(calls)) or real(runners, calls)))
    eng = generate_answers(target, prompts, tmp_path / "engine.jsonl", loop_ngram=n, decoder="engine", **kw)
    assert {r["id"]: r["end"] for r in eng} == {i: r["end"] for i, r in on.items()}
    assert _same_but_near_ties(target, on, {r["id"]: r for r in eng}) == len(prompts)
    # every shared forward has 4 rows while prompts wait; then the batch drains (never refilled from a dip)
    drain = next(j for j, rows in enumerate(forwards) if rows < 4)
    assert drain > max(len(r["answer_ids"]) for r in eng)  # longer than the longest answer: places were refilled
    assert all(a >= b for a, b in zip(forwards[drain:], forwards[drain + 1:]))
    # the criterion alone: per row, True from the step its last n tokens repeat an earlier n-gram
    stop = LoopStop(start=2, n=2, rows=2)
    seqs = torch.tensor([[0, 0, 1, 2, 3, 1, 2, 9], [0, 5, 1, 2, 3, 4, 5, 6]])
    got = [stop(seqs[:, :k]).tolist() for k in range(3, 9)]
    assert got == [[False, False]] * 4 + [[True, False]] * 2


def test_a_learning_curve_point_takes_whole_shards_within_its_positions():
    from verispec.train.pipeline import records_within

    records = [{"prompt_ids": [1] * 6, "answer_ids": [2] * 4} for _ in range(10)]  # 10 positions each
    assert records_within(records, 60, shard_size=3) == 6      # two shards of 30 positions
    assert records_within(records, 89, shard_size=3) == 6      # a third shard would pass 89
    assert records_within(records, 90, shard_size=3) == 9
    assert records_within(records, 10**6, shard_size=3) == 10  # the last, short shard too
    assert records_within(records, 5, shard_size=3) == 3       # never less than one shard


def test_processes_extracting_into_one_folder_share_the_shards(tiny, dataset, tmp_path):
    """A shard another process holds (its lock) is passed over, then waited for: finished by its holder it
    is kept as it is, and the other shards are made meanwhile; a lock released with no shard written (its
    holder died) gets the shard made by the waiting process."""
    import fcntl
    import shutil
    import threading
    import time

    records, _, layers = dataset
    ref = extract_features(tiny, records[:6], tmp_path / "ref", layers, shard_size=3, progress=False, backend="fast")
    for finished_by_holder in (True, False):
        out = tmp_path / f"shared-{finished_by_holder}"
        out.mkdir()
        lock = open(out / "shard_0000.lock", "a")
        fcntl.flock(lock, fcntl.LOCK_EX)  # "another process" holds shard 0
        worker = threading.Thread(target=extract_features, args=(tiny, records[:6], out, layers),
                                  kwargs=dict(shard_size=3, progress=False, backend="fast"))
        worker.start()
        deadline = time.time() + 60
        while not (out / "shard_0001.pt").exists() and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        assert (out / "shard_0001.pt").exists() and worker.is_alive() and not (out / "shard_0000.pt").exists()
        if finished_by_holder:
            shutil.copy(ref[0], out / "shard_0000.pt")
            stamp = (out / "shard_0000.pt").stat().st_mtime_ns
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
        worker.join(60)
        assert not worker.is_alive()
        if finished_by_holder:
            assert (out / "shard_0000.pt").stat().st_mtime_ns == stamp  # kept, not made again
        assert torch.equal(torch.load(out / "shard_0000.pt")["feats"], torch.load(ref[0])["feats"])
