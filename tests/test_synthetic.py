"""The synthetic GGUF writer (models/synthetic.py): its shapes are the published ones and cover what the
fast path must run (head dims 64 and 128, GQA ratios, tied and untied embeddings, Qwen2's q/k/v biases);
tensor types follow llama-quantize's rules; the hand-written K-quant blocks dequantize to sane weights;
files are reproducible; and tiny Llama- and Qwen2-shaped files in each quant type load through the
project's loader (transformers reading them) with the fast path's logits equal to transformers'."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from verispec.errors import InvalidParameter
from verispec.models.synthetic import SHAPES, SIGMA, VOCAB, _q4_k, _q6_k, main, plan, write_gguf, write_synthetic

pytestmark = pytest.mark.usefixtures("one_thread")


def test_shapes_are_the_published_ones_and_cover_what_the_fast_path_must_run():
    # parameter counts at each model's own vocabulary, as its model card states them
    published = {("llama", "0.5b"): (49152, 361_821_120), ("llama", "1b"): (128256, 1_235_814_400),
                 ("llama", "3b"): (128256, 3_212_749_824), ("llama", "8b"): (128256, 8_030_261_248),
                 ("qwen2", "0.5b"): (151936, 494_032_768), ("qwen2", "1b"): (151936, 1_543_714_304),
                 ("qwen2", "3b"): (151936, 3_085_938_688), ("qwen2", "8b"): (152064, 7_615_616_512)}
    for key, (vocab, count) in published.items():
        assert SHAPES[key].params(vocab) == count, key
    sized = [s for (_, size), s in SHAPES.items() if size != "tiny"]
    assert {s.head_dim for s in sized} == {64, 128}
    assert {s.tied for s in sized} == {True, False}
    assert {s.qkv_bias for s in sized} == {True, False}
    assert {s.heads // s.kv_heads for s in sized} == {3, 4, 6, 7, 8}
    assert all(s.heads % s.kv_heads == 0 and s.hidden == s.heads * s.head_dim for s in SHAPES.values())


def test_tensor_types_follow_llama_quantize():
    types = {n: t.name for n, _, t in plan(SHAPES["llama", "8b"], "q4_k_m", VOCAB)}
    # use_more_bits over 32 layers: the first and last eighth, and every third layer between
    more = {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31}
    for i in range(32):
        for t in ("attn_v", "ffn_down"):
            assert types[f"blk.{i}.{t}.weight"] == ("Q6_K" if i in more else "Q4_K")
        assert types[f"blk.{i}.attn_q.weight"] == types[f"blk.{i}.ffn_up.weight"] == "Q4_K"
        assert types[f"blk.{i}.attn_norm.weight"] == "F32"
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    # width 896 is no whole number of 256-weight super-blocks: Q4_K -> Q5_0, Q6_K -> Q8_0 (tied head)
    types = {n: t.name for n, _, t in plan(SHAPES["qwen2", "0.5b"], "q4_k_m", VOCAB)}
    assert types["blk.0.attn_q.weight"] == types["blk.0.ffn_gate.weight"] == "Q5_0"
    assert types["blk.0.attn_q.bias"] == "F32" and types["blk.0.ffn_down.weight"] == "Q6_K"
    assert types["blk.3.ffn_down.weight"] == "Q4_K"  # 4864 wide: whole super-blocks; layer 3 of 24: no more bits
    assert types["token_embd.weight"] == "Q8_0" and "output.weight" not in types
    types = {n: t.name for n, _, t in plan(SHAPES["llama", "1b"], "q4_0", VOCAB)}
    assert types.pop("token_embd.weight") == "Q6_K"  # the tied LM head
    assert {t for n, t in types.items() if "norm" not in n} == {"Q4_0"}
    types = {n: t.name for n, _, t in plan(SHAPES["qwen2", "8b"], "q8_0", VOCAB)}
    assert {t for n, t in types.items() if "norm" not in n and "bias" not in n} == {"Q8_0"}


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_hand_written_k_blocks_dequantize_to_centred_weights_of_the_intended_spread(kind):
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    blocks = (_q4_k if kind == "Q4_K" else _q6_k)(rng, 2048)
    assert blocks.shape == (2048, 144 if kind == "Q4_K" else 210)
    w = dequantize(blocks, getattr(GGMLQuantizationType, kind)).reshape(-1, 32)
    assert abs(float(w.mean())) < 0.03 * SIGMA
    assert 0.9 * SIGMA < float(w.std()) < 1.1 * SIGMA
    # every group near 0: a min or scale packed into the wrong bits shifts groups by many times SIGMA
    assert float(np.abs(w.mean(axis=1)).max()) < SIGMA


def test_files_are_reproducible_and_follow_the_seed(tmp_path):
    a = write_synthetic(tmp_path / "a.gguf", "llama", "tiny", "q4_k_m", seed=1).read_bytes()
    assert write_synthetic(tmp_path / "b.gguf", "llama", "tiny", "q4_k_m", seed=1).read_bytes() == a
    assert write_synthetic(tmp_path / "c.gguf", "llama", "tiny", "q4_k_m", seed=2).read_bytes() != a
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.gguf", "c.gguf"]  # no temporary left


def test_bad_input_is_one_typed_error(tmp_path, capsys):
    with pytest.raises(InvalidParameter, match="size"):
        write_synthetic(tmp_path / "x.gguf", "llama", "70b", "q4_0")
    with pytest.raises(InvalidParameter, match="quant"):
        write_synthetic(tmp_path / "x.gguf", "llama", "tiny", "q2_k")
    with pytest.raises(InvalidParameter, match="blocks"):  # a width of no whole Q4_0 block
        plan(dataclasses.replace(SHAPES["llama", "tiny"], hidden=200, heads=2, kv_heads=1), "q4_0", VOCAB)
    with pytest.raises(SystemExit):
        main(["--arch", "gpt2", "--size", "tiny", "--quant", "q4_0", "--out", str(tmp_path / "x.gguf")])
    assert not (tmp_path / "x.gguf").exists()


# tiny files covering every quant type and both archs; between them head dims 64 and 128, GQA 2 and 4, tied and
# untied embeddings, and Qwen2's biases in both (SHAPES' tiny ones: llama tied / head dim 64, qwen2
# untied / head dim 128)
CASES = {
    "llama-q4_0": ("llama", "q4_0", {"kv_heads": 1}),  # GQA 4
    "llama-q4_k_m": ("llama", "q4_k_m", {"tied": False, "heads": 2, "kv_heads": 1}),  # untied, head dim 128
    "qwen2-q4_k_m": ("qwen2", "q4_k_m", {"tied": True, "heads": 4, "kv_heads": 2}),  # tied, head dim 64
    "qwen2-q8_0": ("qwen2", "q8_0", {}),
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache of this module's own for the loader's conversions."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VERISPEC_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module", params=list(CASES))
def written(request, cache, tmp_path_factory):
    """(shape, quant, the file, the project's loader's LoadedModel of it), once per case."""
    from verispec.models import load_model

    arch, quant, changes = CASES[request.param]
    shape = dataclasses.replace(SHAPES[arch, "tiny"], **changes)
    path = write_gguf(tmp_path_factory.mktemp(request.param) / f"{request.param}.gguf", shape, quant, seed=3)
    return shape, quant, path, load_model(str(path))


# the loader converts each file through transformers (tens of seconds each on a busy 2-core machine)
# and the files carry the embedded SmolLM2 package's tokenizer
@pytest.mark.real_model
def test_transformers_reads_the_file_as_written(written):
    shape, _, _, target = written
    cfg, model = target.model.config, target.model
    assert cfg.model_type == shape.arch
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size) == (shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.ffn)
    assert model.model.layers[0].self_attn.head_dim == shape.head_dim
    assert cfg.tie_word_embeddings == shape.tied
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) == shape.tied
    assert target.vocab_size == VOCAB
    for layer in model.model.layers:
        att = layer.self_attn
        for proj in (att.q_proj, att.k_proj, att.v_proj):
            assert (proj.bias is not None) == shape.qkv_bias
            if shape.qkv_bias:  # the file's U(-0.5, 0.5), not a default zero
                assert 0.2 < float(proj.bias.detach().abs().mean()) < 0.3
        for w in (att.q_proj.weight.detach(), layer.mlp.down_proj.weight.detach()):
            assert abs(float(w.mean())) < 0.1 * SIGMA and 0.9 * SIGMA < float(w.std()) < 1.1 * SIGMA
    # SmolLM2's tokenizer, chat template included
    ids = target.encode(prompt="Hello world")
    assert target.decode(ids) == "Hello world" and len(ids) == 2
    chat = target.tokenizer.decode(target.encode(chat="Hi"))
    assert chat.startswith("<|im_start|>system\n") and "<|im_start|>user\nHi<|im_end|>" in chat
    assert 2 in target.eos_token_ids


@pytest.mark.real_model
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("exact", [False, True])
def test_fast_path_logits_equal_transformers(written, exact, native):
    """test_fast.py's check on the loaded file: prefill, one token, a pass over the exact bucket, the rest;
    the native C++ step where built, and the Python step."""
    from verispec.backends.fast import FastRunner
    from verispec.fast import supports

    target = written[3]
    assert supports(target.model)
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = target.model(input_ids=ids[None]).logits[0].float()
    runner = FastRunner(target.model, capacity=64, exact=exact, exact_bucket=4, exact_max_rows=4, native=native)
    last = runner.forward(ids[:17], last_only=True).logits
    steps = [runner.forward(ids[17:18]).logits, runner.forward(ids[18:27]).logits, runner.forward(ids[27:]).logits]
    got = torch.cat([last] + steps)
    assert got.shape == (24, VOCAB)
    torch.testing.assert_close(got, ref[16:], atol=2e-5, rtol=1e-4)


@pytest.mark.real_model
@pytest.mark.parametrize("written", [name for name in CASES if name.endswith("q4_k_m")], indirect=True)
def test_the_files_4_bit_blocks_are_what_transformers_dequantized(written):
    """models/gguf_weights.py takes a projection's Q4_0 / Q4_K blocks only where they dequantize bit for bit
    to the loader's float32 weight (q and k in Llama's permuted row order): so the hand-written Q4_K
    blocks are read as transformers reads them. Q6_K / Q8_0 tensors come back as the float32 weight."""
    from verispec.fast import quant

    shape, q, _, target = written  # the Q4_K_M files: Q4_0 blocks come from gguf.quants (test_quant.py reads them)
    types = {n: t.name for n, _, t in plan(shape, q, VOCAB)}
    source = target.weight_source
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_down": "mlp.down_proj"}
    seen = set()
    for i in range(shape.layers):
        for gguf_name, hf in names.items():
            kind = types[f"blk.{i}.{gguf_name}.weight"]
            got = source(f"model.layers.{i}.{hf}.weight")
            assert isinstance(got, quant.Groups) == (kind == "Q4_K"), (i, gguf_name, kind)
            seen.add(kind)
    assert seen == {"Q4_K", "Q6_K"}
