"""EAGLE heads across engines (verispec/heads/interop.py): an eagle3-layout head drafts exactly; export to
vLLM's speculators format and SGLang's EAGLE-3 layout, import back (same draft distributions, identical
tensors on a second round trip); refusals for what EAGLE-3 cannot hold; and the proof with the real
library: speculators' own Eagle3DraftModel loads the export and computes the same draft logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import loaded, tiny_llama
from verispec.drafters.eagle import EagleDrafter, EagleHead, load_eagle_head
from verispec.engine import Engine
from verispec.errors import HeadMismatch
from verispec.heads import read_head, save_head
from verispec.heads.interop import export_head, import_head
from verispec.types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = [1, 2, 3]  # transformers hidden_states indices of the 4-layer tiny target


@pytest.fixture(scope="module")
def tiny():
    return loaded(tiny_llama(vocab=48, seed=5, layers=4))


def eagle3_head(target, seed: int = 2, vocab: int = 24, norm_before_residual: bool = False) -> EagleHead:
    """A random eagle3-layout head whose draft vocabulary is a shuffled subset of the target's (so the
    export has to reorder it) and whose norms are not all ones (so a swapped norm would show)."""
    torch.manual_seed(seed)
    cfg = EagleHead.make_config(target, vocab, feature_layers=LAYERS, layout="eagle3")
    cfg["norm_before_residual"] = norm_before_residual
    cfg["rms_norm_eps"] = 1e-6
    head = EagleHead(cfg)
    head.d2t.copy_(torch.randperm(target.vocab_size)[:vocab])
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
        head.lm_head.weight.mul_(10.0)
    head.attach_embedding(target.model.get_input_embeddings().weight)
    return head.eval()


def teacher_forced_logits(head: EagleHead, features: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Draft logits [T, Vd] for `steps` training-time-test steps over one sequence, with the attention
    pattern of EAGLE-3's training forward: step 1 causal; step s reads the tokens shifted by s - 1, the
    step s - 1 outputs as hidden states, at positions + s - 1, and sees step 1's keys causally plus its
    own keys of earlier steps on the diagonal."""
    T = ids.shape[0]
    g = head.project(features)
    toks, out, ks, vs = ids, [], [], []
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    eye = torch.eye(T, dtype=torch.bool)
    for s in range(steps):
        x = head.inputs(toks, g)
        q, k, v = head.qkv(x, torch.arange(T) + s)
        ks.append(k)
        vs.append(v)
        mask = torch.cat([causal] + [eye] * s, dim=1)
        att = F.scaled_dot_product_attention(q[None], torch.cat(ks, 1)[None], torch.cat(vs, 1)[None], attn_mask=mask,
                                             enable_gqa=True)[0]
        g = head.finish(x, att)
        out.append(head.logits(g))
        toks = torch.cat([ids[s + 1:], ids.new_zeros(s + 1)])
    return out


def to_target_vocab(lg: torch.Tensor, d2t: torch.Tensor, vocab: int) -> torch.Tensor:
    full = lg.new_full((*lg.shape[:-1], vocab), float("-inf"))
    full[..., d2t] = lg
    return full


def _save(head: EagleHead, path: Path) -> Path:
    return save_head(path, dict(head.config), head.state_dict(), dtype=torch.float32)


@pytest.mark.parametrize("backend", ["hf", "fast"])
def test_eagle3_layout_drafts_exactly(tiny, backend):
    plain = Engine.for_model(tiny, None, backend=backend)
    prompts = [[1, 5, 9, 2], [7, 7, 7, 1, 2, 3, 11, 40]]
    for nbr in (False, True):
        # the fast backend drafts with packed bfloat16 weight copies, as a shipped head does
        drafter = EagleDrafter(eagle3_head(tiny, norm_before_residual=nbr), tiny.vocab_size,
                               weights_dtype=torch.bfloat16 if backend == "fast" else None)
        for tree in (None, "dynamic"):
            engine = Engine.for_model(tiny, drafter, draft_length=4, tree=tree, backend=backend)
            for p in prompts:
                got = engine.generate(p, SamplingParams(max_new_tokens=24))
                assert got.token_ids == plain.generate(p, SamplingParams(max_new_tokens=24)).token_ids, (backend, nbr, tree)
                assert got.stats.drafted > 0


@pytest.mark.parametrize("fmt", ["speculators", "eagle3"])
def test_export_import_same_draft_distribution(tiny, tmp_path, fmt):
    head = eagle3_head(tiny)
    src = _save(head, tmp_path / "verispec")
    config, tensors = read_head(src, "eagle", tiny)
    out = export_head(config, tensors, tmp_path / fmt, fmt, embedding=tiny.model.get_input_embeddings().weight,
                      verifier="tiny/llama", dtype=torch.float32)
    meta = json.loads((out / "config.json").read_text())
    written = load_file(str(out / "model.safetensors"))
    ids = written["d2t"] + torch.arange(written["d2t"].numel())
    assert ids.tolist() == sorted(head.d2t.tolist())  # draft vocabulary in target-id order
    assert written["t2d"].nonzero().flatten().tolist() == ids.tolist()
    if fmt == "speculators":
        assert meta["eagle_aux_hidden_state_layer_ids"] == LAYERS
        assert "layers.0.self_attn.q_proj.weight" in written and "embed_tokens.weight" in written
        assert written["layers.0.self_attn.q_proj.weight"].shape == (32, 64)  # reads [embedding, hidden]
    else:
        assert meta["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in LAYERS]
        assert "midlayer.hidden_norm.weight" in written and "embed_tokens.weight" not in written
    back = load_eagle_head(tiny, out)
    assert back.feature_layers == LAYERS and back.layout == "eagle3"
    torch.manual_seed(0)
    feats, toks = torch.randn(9, 3 * 32), torch.randint(0, 48, (9,))
    with torch.no_grad():
        for a, b in zip(teacher_forced_logits(head, feats, toks, 2), teacher_forced_logits(back, feats, toks, 2)):
            torch.testing.assert_close(to_target_vocab(a, head.d2t, 48), to_target_vocab(b, back.d2t, 48),
                                       rtol=1e-5, atol=1e-5)
    # and it drafts exactly from the imported form
    plain = Engine.for_model(tiny, None, backend="hf").generate([3, 1, 4, 1, 5], SamplingParams(max_new_tokens=20))
    got = Engine.for_model(tiny, EagleDrafter(back, 48), draft_length=3, backend="hf").generate(
        [3, 1, 4, 1, 5], SamplingParams(max_new_tokens=20))
    assert got.token_ids == plain.token_ids


@pytest.mark.parametrize("fmt", ["speculators", "eagle3"])
def test_second_round_trip_gives_identical_files(tiny, tmp_path, fmt):
    head = eagle3_head(tiny, seed=4)
    emb = tiny.model.get_input_embeddings().weight
    config, tensors = read_head(_save(head, tmp_path / "v"), "eagle", tiny)
    first = export_head(config, tensors, tmp_path / "a", fmt, embedding=emb, verifier="tiny/llama", dtype=torch.float32)
    config2, tensors2 = import_head(first, tiny)
    second = export_head(config2, tensors2, tmp_path / "b", fmt, embedding=emb, verifier="tiny/llama", dtype=torch.float32)
    a, b = load_file(str(first / "model.safetensors")), load_file(str(second / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert json.loads((first / "config.json").read_text()) == json.loads((second / "config.json").read_text())


def test_refusals(tiny, tmp_path):
    emb = tiny.model.get_input_embeddings().weight
    # verispec's own layout has no EAGLE-3 form
    torch.manual_seed(0)
    own = EagleHead(EagleHead.make_config(tiny, 24, feature_layers=LAYERS))
    config, tensors = read_head(save_head(tmp_path / "own", dict(own.config), own.state_dict()), "eagle", tiny)
    with pytest.raises(HeadMismatch, match="verispec's layout.*--layout eagle3"):
        export_head(config, tensors, tmp_path / "x", "speculators", embedding=emb)
    # the last hidden state (final norm applied) cannot be named
    head = eagle3_head(tiny)
    cfg = dict(head.config, feature_layers=[2, 3, 4])
    with pytest.raises(HeadMismatch, match=r"feature layer\(s\) \[4\]"):
        export_head(cfg, head.state_dict(), tmp_path / "x", "eagle3")
    with pytest.raises(HeadMismatch, match="unknown export format"):
        export_head(dict(head.config), head.state_dict(), tmp_path / "x", "onnx")
    # a head with layers after the first (--head-layers) has no one-layer EAGLE-3 form
    deep = EagleHead(dict(head.config, num_layers=2))
    with pytest.raises(HeadMismatch, match="has 2 layers.*--head-layers 1"):
        export_head(dict(deep.config), deep.state_dict(), tmp_path / "x", "speculators", embedding=emb)
    out = export_head(dict(head.config), head.state_dict(), tmp_path / "s", "speculators", embedding=emb, dtype=torch.float32)
    meta = json.loads((out / "config.json").read_text())
    for key, value, msg in [("norm_output", True, "norm_output"), ("fc_norm", True, "fc_norm"),
                            ("speculators_model_type", "mtp", "'mtp' speculator")]:
        bad = tmp_path / f"bad_{key}"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**meta, key: value}))
        (bad / "model.safetensors").symlink_to(out / "model.safetensors")
        with pytest.raises(HeadMismatch, match=msg):
            load_eagle_head(tiny, bad)
    for key, value, msg in [("num_hidden_layers", 2, "2 decoder layers"), ("model_type", "qwen3", "q/k norms"),
                            ("rope_parameters", {"rope_type": "llama3", "rope_theta": 1e4}, "rotary scaling"),
                            ("vocab_size", 64, "vocabulary of 64")]:
        bad = tmp_path / f"bad_layer_{key}"
        bad.mkdir()
        layer = {**meta["transformer_layer_config"], key: value}
        (bad / "config.json").write_text(json.dumps({**meta, "transformer_layer_config": layer}))
        (bad / "model.safetensors").symlink_to(out / "model.safetensors")
        with pytest.raises(HeadMismatch, match=msg):
            load_eagle_head(tiny, bad)
    # an embedding that is not the target's
    other = loaded(tiny_llama(vocab=48, seed=6, layers=4))
    with pytest.raises(HeadMismatch, match="embedding that is not"):
        load_eagle_head(other, out)


@pytest.mark.real_model
def test_cli_exports_the_shipped_head_and_refuses_in_one_line(smollm2, tmp_path):
    """The shipped SmolLM2 head has EAGLE-3's layout: `verispec export` writes its speculators form; a head
    in verispec's own layout is refused in one line that says what to change, exit 2."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "verispec", "export", "--to", "speculators", "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "o" / "config.json").read_text()) and (tmp_path / "o" / "model.safetensors").is_file()
    own = EagleHead(EagleHead.make_config(smollm2, 64, layout="verispec"))
    save_head(tmp_path / "own", dict(own.config), own.state_dict())
    r = subprocess.run([sys.executable, "-m", "verispec", "export", "--to", "speculators", "--head", str(tmp_path / "own"),
                        "--out", str(tmp_path / "o2")], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip() and "Loading weights" not in l and "Warning" not in l]
    assert "Traceback" not in r.stderr and len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert "--layout eagle3" in lines[0]
    r = subprocess.run([sys.executable, "-m", "verispec", "export", "--to", "onnx", "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and "unknown export format" in r.stderr


def test_speculators_library_loads_the_export(tiny, tmp_path):
    """The proof with the real library (its own venv, tests/speculators_env.py): speculators'
    Eagle3DraftModel loads verispec's export and its forward gives verispec's draft logits on the same
    features and tokens, two training-time-test steps deep; the checkpoint the library then saves
    imports into verispec and exports back to identical tensors."""
    import speculators_env

    head = eagle3_head(tiny, seed=7)
    emb = tiny.model.get_input_embeddings().weight
    tiny.model.save_pretrained(tmp_path / "target")  # the verifier the library reads (layer count, hidden size)
    config, tensors = read_head(_save(head, tmp_path / "v"), "eagle", tiny)
    out = export_head(config, tensors, tmp_path / "spec", "speculators", embedding=emb, dtype=torch.float32,
                      verifier=str(tmp_path / "target"))
    torch.manual_seed(1)
    T, steps = 11, 2
    feats, toks = torch.randn(T, 3 * 32), torch.randint(0, 48, (T,))
    torch.save({"features": feats[None], "ids": toks[None], "steps": steps}, tmp_path / "in.pt")
    r = speculators_env.run(Path(__file__).with_name("speculators_probe.py"), str(out), str(tmp_path / "in.pt"),
                            str(tmp_path / "out.pt"), str(tmp_path / "saved"))
    assert r.returncode == 0, r.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    assert got["class"] == "speculators.models.eagle3.core.Eagle3DraftModel"
    with torch.no_grad():
        want = teacher_forced_logits(head, feats, toks, steps)
    assert len(got["logits"]) == steps
    their_ids = got["d2t"] + torch.arange(got["d2t"].numel())
    for mine, theirs in zip(want, got["logits"]):
        a = to_target_vocab(mine, head.d2t, 48)
        b = to_target_vocab(theirs[0], their_ids, 48)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    # the library's own save -> verispec -> export: the same tensors it wrote
    saved = tmp_path / "saved"
    lib = load_file(str(saved / "model.safetensors"))
    config2, tensors2 = import_head(saved, tiny)
    again = export_head(config2, tensors2, tmp_path / "again", "speculators", embedding=emb, dtype=torch.float32,
                        verifier=str(tmp_path / "target"))
    mine = load_file(str(again / "model.safetensors"))
    assert mine.keys() == lib.keys()
    for k in lib:
        assert lib[k].dtype == mine[k].dtype and torch.equal(lib[k], mine[k]), k


@pytest.mark.real_model
def test_speculators_library_loads_a_smollm2_export(smollm2, tmp_path):
    """The same proof at SmolLM2-135M's shapes (9 query / 3 key-value heads, head_dim 64, rope theta 1e5,
    a 2,048-token draft vocabulary of 49,152) on the target's real features: a random eagle3 head exported
    in bfloat16 as it would ship; the library's logits equal verispec's on the same bf16 weights."""
    import speculators_env

    torch.manual_seed(3)
    cfg = EagleHead.make_config(smollm2, 2048, layout="eagle3")
    head = EagleHead(cfg)
    head.d2t.copy_(torch.randperm(smollm2.vocab_size)[:2048])
    head.attach_embedding(smollm2.model.get_input_embeddings().weight)
    with torch.no_grad():  # the weights as bfloat16 stores them, so both sides read the same numbers
        for p in head.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    smollm2.model.config.save_pretrained(tmp_path / "target")
    from safetensors.torch import save_file

    sd = smollm2.model.state_dict()
    # the verifier weights the library reads (embedding; SmolLM2 ties its LM head to it; final norm)
    save_file({"model.embed_tokens.weight": sd["model.embed_tokens.weight"].clone(),
               "model.norm.weight": sd["model.norm.weight"].clone()}, str(tmp_path / "target" / "model.safetensors"))
    config, tensors = read_head(save_head(tmp_path / "v", dict(head.config), head.state_dict()), "eagle", smollm2)
    out = export_head(config, tensors, tmp_path / "spec", "speculators",
                      embedding=smollm2.model.get_input_embeddings().weight, verifier=str(tmp_path / "target"))
    ids = smollm2.encode(chat=[{"role": "user", "content": "Name three rivers of Europe."}])
    with torch.no_grad():
        hs = smollm2.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i][0] for i in head.feature_layers], -1)
    toks = torch.tensor(ids[1:] + [ids[-1]])  # entry t reads the token after t
    torch.save({"features": feats[None], "ids": toks[None], "steps": 2}, tmp_path / "in.pt")
    r = speculators_env.run(Path(__file__).with_name("speculators_probe.py"), str(out), str(tmp_path / "in.pt"),
                            str(tmp_path / "out.pt"), str(tmp_path / "saved"))
    assert r.returncode == 0, r.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        want = teacher_forced_logits(head, feats, toks, 2)
    their_ids = got["d2t"] + torch.arange(got["d2t"].numel())
    for mine, theirs in zip(want, got["logits"]):
        a = to_target_vocab(mine, head.d2t, smollm2.vocab_size)
        b = to_target_vocab(theirs[0], their_ids, smollm2.vocab_size)
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-3)
