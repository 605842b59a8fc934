"""Quantized weights (fast/quant.py, models/gguf_weights.py): the mapping of GGUF 4-bit blocks onto
PyTorch's int4 kernel and its largest weight difference, the int8 requantization's, the GGUF block
reader against the gguf package's own dequantization, the row-invariance probe seeing the quantized
kernels, and greedy speculation bit-identical to plain decoding under q8 and q4 in bf16 exact mode."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
from conftest import loaded, tiny_llama

from verispec.api import build_engine
from verispec.backends.fast import FastRunner
from verispec.fast import qmm, quant
from verispec.fast.core import layer_step, projection_names
from verispec.models.gguf_weights import parse_q4, parse_q4_k, rope_rows
from verispec.types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
BF16_U = 2.0 ** -8  # bfloat16 keeps 8 significant bits: rounding to nearest moves a value by <= 2^-8 of it



@pytest.fixture(params=["qmm", "torch"])
def kernel(request, monkeypatch):
    """Run a test on qmm.py's kernel (where this CPU has it) and on PyTorch's weight-only kernels."""
    if request.param == "torch":
        monkeypatch.setattr(quant, "_use_qmm", lambda: False)
    elif qmm.available() is not None:
        pytest.skip(f"qmm kernel: {qmm.available()}")
    return request.param


def _channel_scale(w) -> torch.Tensor:
    """An 8-bit weight's per-channel scale."""
    if isinstance(w, qmm.QWeight):
        return w.sc.reshape(-1)  # [N / 16, 16] -> [N]
    return w.scale.float()


needs = pytest.mark.skipif(any(quant.available(f, torch.bfloat16, CPU) for f in ("q4", "q8")),
                           reason="this torch build lacks the weight-only int4/int8 CPU kernels")


def _q4_1_groups(n: int, k: int, seed: int = 0) -> quant.Groups:
    """Groups as a GGUF Q4_1 file stores them: d and m rounded to float16, with a spread of scales and
    offsets (some groups far from zero, where m + 8 d is large)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
    w += 3 * torch.randn(n, k // quant.GROUP, generator=g).repeat_interleave(quant.GROUP, 1)
    r = quant.requantize_groups(w)
    return quant.Groups(r.q, r.d.half().float(), r.m.half().float())


def test_q4_1_blocks_map_onto_the_int4_kernel_within_the_bf16_rounding_of_scale_and_zero():
    gr = _q4_1_groups(64, 256)
    w = quant.to_int4(gr, torch.bfloat16)
    ref = gr.dense()  # the GGUF's float32 dequantization: d * q + m
    err = (quant.effective(w, gr) - ref).abs()
    # the only loss: d and m + 8 d rounded to bfloat16, so |err| <= |q - 8| |d - bf16(d)| + |z - bf16(z)|
    d, z = gr.d, gr.m + 8 * gr.d
    bound = (8 * d.abs() + z.abs()) * BF16_U
    assert (err <= bound.repeat_interleave(quant.GROUP, 1) * (1 + 1e-6) + 1e-7).all()
    assert err.max() > 0  # bfloat16 scales do lose something here, so the bound is what is tested
    # where d and m + 8 d are bfloat16 numbers the mapping is exact (up to float32 rounding of the sums)
    d, z = gr.d.bfloat16().float(), (gr.m + 8 * gr.d).bfloat16().float()
    exact = quant.Groups(gr.q, d, z - 8 * d)
    diff = (quant.effective(quant.to_int4(exact, torch.bfloat16), exact) - exact.dense()).abs()
    assert (diff <= 2.0 ** -21 * (8 * d.abs() + z.abs()).repeat_interleave(quant.GROUP, 1)).all()
    # and the kernel computes with those weights (its own float32 sums, one bfloat16 rounding of the output)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    want = x.double() @ quant.effective(w, gr).double().T
    torch.testing.assert_close(quant.linear(x, w).double(), want, atol=0.05, rtol=BF16_U)


def test_q8_requantization_is_within_half_a_step_per_channel():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, 96, generator=g) * torch.exp(torch.randn(48, 1, generator=g))
    q = quant.to_int8(w, torch.bfloat16)
    step = q.scale.float()
    assert (step * 127 >= w.abs().amax(1)).all()  # the scale rounds up: no weight clips
    assert (step * 127 <= w.abs().amax(1) * (1 + 2 * BF16_U)).all()
    err = (quant.effective(q) - w).abs()
    assert (err <= step[:, None] / 2 * (1 + 1e-6)).all()
    x = torch.randn(3, 96, generator=g).bfloat16()
    torch.testing.assert_close(quant.linear(x, q).double(), x.double() @ quant.effective(q).double().T,
                               atol=0.05, rtol=BF16_U)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_block_reader_equals_the_gguf_packages_dequantization(kind):
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qt = getattr(GGMLQuantizationType, kind)
    w = np.random.default_rng(3).standard_normal((16, 128)).astype(np.float32) + 1.5
    raw = quantize(w, qt)
    groups = parse_q4(raw, kind, (16, 128))
    assert torch.equal(groups.dense(), torch.from_numpy(dequantize(raw, qt)))


def test_q4_k_reader_equals_the_gguf_packages_dequantization():
    """Q4_K super-blocks (Gemma 3's file) from random bytes: every scale/min bit pattern and nibble, with
    finite fp16 d and dmin."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(4)
    n, k = 8, 512
    raw = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    for lo in (0, 2):  # d, dmin
        raw[..., lo:lo + 2] = (rng.random((n, k // 256, 1)) * 0.01).astype(np.float16).view(np.uint8)
    raw = raw.reshape(n, -1)
    groups = parse_q4_k(raw, (n, k))
    assert torch.equal(groups.dense(), torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_K)))
    assert groups.d.shape == (n, k // quant.GROUP)


def test_rope_rows_undo_llama_cpps_q_k_permutation():
    heads, per, k = 3, 8, 4
    hf = torch.arange(heads * per * k).reshape(heads * per, k)
    # llama.cpp's converter: each head's rows (2, per / 2) stored as (per / 2, 2)
    gguf = hf.reshape(heads, 2, per // 2, k).transpose(1, 2).reshape(heads * per, k)
    assert torch.equal(gguf[rope_rows(heads * per, heads)], hf)


@needs
def test_quantized_formats_fall_back_to_dense_weights_and_say_why():
    model = tiny_llama(layers=1, hidden=64)  # float32: the quantized kernels take bfloat16 activations
    runner = FastRunner(model, capacity=64, weights="q4")
    assert runner.net.weights == "bf16" and "bfloat16" in runner.net.weights_note
    with pytest.raises(ValueError):
        FastRunner(model, capacity=64, weights="q3")


@needs
@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_quantized_runner_logits_and_pass_independent_bits(fmt, kernel):
    model = tiny_llama(layers=3, hidden=64).to(torch.bfloat16)
    ids = torch.randint(0, 32, (50,), generator=torch.Generator().manual_seed(8))
    dense = FastRunner(model, capacity=128, exact=False)
    runner = FastRunner(model, capacity=128, exact=False, weights=fmt)
    assert runner.net.weights == fmt
    ws = [runner.net.layers[0][k] for k in ("wqkv", "wo", "wgu", "wdown")] + [runner.net.lm_head]
    want = qmm.QWeight if kernel == "qmm" else (quant.Int4 if fmt == "q4" else quant.Int8)
    assert {type(w) for w in ws} == {want} and {quant.is_int4(w) for w in ws} == {fmt == "q4"}
    for r in (dense, runner):
        r.forward(ids[:10], last_only=True)
    a, b = dense.forward(ids[10:30]).logits, runner.forward(ids[10:30]).logits
    assert not torch.equal(a, b)  # other weights ...
    torch.testing.assert_close(b, a, atol=1.5 if fmt == "q4" else 0.5, rtol=0.1)  # ... close to the dense ones
    # exact mode: a position's logits do not depend on how many positions share its pass
    out = []
    for cuts in ([(i, i + 1) for i in range(10, 50)], [(10, 13), (13, 20), (20, 21), (21, 37), (37, 50)]):
        r = FastRunner(model, capacity=128, exact=True, kv_block=16, weights=fmt)
        r.forward(ids[:10], last_only=True)
        out.append(torch.cat([r.forward(ids[a:b]).logits for a, b in cuts]))
    assert torch.equal(out[0], out[1])


@needs
def test_row_invariance_probe_runs_the_quantized_kernels(monkeypatch):
    """A quantized kernel that rounds otherwise below 3 rows must raise exact mode's row floor to 3."""
    real = quant.linear

    def below_three(x, w, b=None):
        y = real(x, w, b)
        return y * (1 + 2 ** -7) if x.shape[0] < 3 else y  # one bfloat16 ulp: another rounding
    floors = {}
    for name, lin in (("real", real), ("planted", below_three)):
        monkeypatch.setattr(quant, "linear", lin)
        model = tiny_llama(layers=2, hidden=64).to(torch.bfloat16)  # a new model: runners of one share its module
        r = FastRunner(model, capacity=64, exact=True, exact_max_rows=8, weights="q4")
        assert r.net.linear is lin
        floors[name] = r.net.row_floor(8, r.kv_block)
    assert floors["planted"] is not None and floors["planted"] >= 3
    assert floors["real"] is None or floors["real"] <= floors["planted"]


@needs
def test_row_invariance_probe_runs_each_format_a_shape_has(monkeypatch):
    """A file may store one projection in 4 bits in some layers and more in others (Gemma's Q4_K_M): the
    probe must run that shape on both kernels. Planted: int4 rounding otherwise below 3 rows, for the
    q/k/v shape only, which runs int4 in layer 0 and int8 in layer 1 (the format built last)."""
    model = tiny_llama(layers=2, hidden=64).to(torch.bfloat16)
    params = dict(model.named_parameters())

    def source(name):  # layer 0: 4-bit groups; everything else: float32 weights (int8 in q4)
        w = params[name].detach().float()
        return quant.requantize_groups(w) if name.startswith("model.layers.0.") else w
    real = quant.linear
    qkv = (128, 64)

    def int4_qkv_below_three(x, w, b=None):
        y = real(x, w, b)
        planted = quant.is_int4(w) and quant.shape(w) == qkv and x.shape[0] < 3
        return y * (1 + 2 ** -7) if planted else y
    monkeypatch.setattr(quant, "linear", int4_qkv_below_three)
    r = FastRunner(model, capacity=64, exact=True, exact_max_rows=8, weights="q4", weight_source=source)
    net = r.net
    assert quant.is_int4(net.layers[0]["wqkv"]) and not quant.is_int4(net.layers[1]["wqkv"])
    assert quant.shape(net.layers[1]["wqkv"]) == qkv
    assert net.row_floor(8, r.kv_block) >= 3


@needs
@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_greedy_speculation_equals_plain_decoding_with_quantized_weights(fmt, kernel):
    target = loaded(tiny_llama(layers=3, hidden=64).to(torch.bfloat16))
    target.weights = fmt
    draft = loaded(tiny_llama(layers=1, hidden=64, seed=1).to(torch.bfloat16), name="draft")
    params = SamplingParams(max_new_tokens=40)
    for prompt in ([1, 2, 3, 4, 1, 2, 3], [5, 9, 5, 9, 5, 9, 17]):
        plain = build_engine(target, "ar", backend="fast")
        assert plain.runner.net.weights == fmt and plain.runner.mode.exact
        want = plain.generate(prompt, params).token_ids
        for method, opts in (("ngram", {}), ("draft", {"draft": draft}), ("ngram", {"tree": "static:small"})):
            assert build_engine(target, method, backend="fast", **opts).generate(prompt, params).token_ids == want
    # the API's weights= overrides the loaded model's format, and a model without a GGUF runs dense on "auto"
    assert build_engine(target, "ar", backend="fast", weights="bf16").runner.net.weights == "bf16"
    assert build_engine(target, "ar", backend="fast", weights="auto").runner.net.weights == "bf16"


@pytest.mark.real_model
@needs
def test_smollm2_q4_runs_the_files_own_blocks():
    """The embedded SmolLM2 GGUF: every projection runs its Q4_1 blocks on the int4 kernel within the
    stated bound of the file's float32 dequantization, the Q8_0 LM head as int8 within half a step;
    greedy n-gram speculation equals plain decoding on it (bf16, exact mode)."""
    from verispec.models import load_model

    target = load_model("smollm2-135m", dtype="bfloat16", weights="q4")
    source = target.weight_source
    runner = FastRunner(target.model, capacity=512, weights="q4", weight_source=source)
    net = runner.net
    worst = 0.0
    for i, lw in enumerate(net.layers):
        for key, names in projection_names(i).items():
            groups = quant.Groups.cat([source(n) for n in names])  # Groups: the file's blocks, checked on read
            assert quant.is_int4(lw[key])
            ref = torch.cat([source.dense(n) for n in names])  # the file's float32 dequantization
            err = (quant.dequantized(groups, lw[key]) - ref).abs()  # qmm keeps d and m in float32: ~0
            bound = ((8 * groups.d.abs() + (groups.m + 8 * groups.d).abs()) * BF16_U).repeat_interleave(32, 1)
            assert (err <= bound * (1 + 1e-6) + 1e-7).all()
            worst = max(worst, float(err.max()))
    # PyTorch's int4 kernel: 0.0215 on this file (results/xeon/kernels/quant_error_smollm2-135m.json); qmm: 2.4e-7
    assert worst <= (2 ** -5 if isinstance(lw[key], quant.Int4) else 1e-6)
    head = source.dense("lm_head.weight")
    assert not quant.is_int4(net.lm_head)
    err = (quant.dequantized(head, net.lm_head) - head).abs()
    assert (err <= _channel_scale(net.lm_head)[:, None] / 2 * (1 + 1e-6)).all()
    ids = target.encode(chat="Repeat this list, then sort it: pear, fig, apple, plum, kiwi, lime.")
    params = SamplingParams(max_new_tokens=24)
    plain = build_engine(target, "ar", backend="fast", runner=runner).generate(ids, params).token_ids
    assert build_engine(target, "ngram", backend="fast", runner=runner).generate(ids, params).token_ids == plain


def test_no_dense_copy_where_bf16_has_no_instructions_and_qmm_runs(monkeypatch):
    """On AVX2 CPUs the dense copy would be packed.py's bf16 hybrid, slower than qmm at every row count."""
    from verispec.fast import packed

    real = packed.available
    monkeypatch.setattr(quant, "_use_qmm", lambda: True)
    monkeypatch.setattr(packed, "available", lambda dtype, device: dtype != torch.bfloat16 and real(dtype, device))
    assert quant.wide_rows("q4") is None and quant.wide_rows("q8") is None
    monkeypatch.setattr(packed, "available", lambda dtype, device: True)
    assert quant.wide_rows("q4") == quant.WIDE_ROWS_QMM["q4"]
    monkeypatch.setattr(quant, "_use_qmm", lambda: False)
    assert quant.wide_rows("q8") == quant.WIDE_ROWS["q8"]


@needs
@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_wide_passes_run_a_dense_copy_of_the_same_weights_outside_exact_mode(fmt, monkeypatch):
    """Passes of quant.wide_rows(fmt) rows or more that may round otherwise than plain decoding (prefill, passes
    outside exact mode) run the dense copy: the same weights (their dequantization in bfloat16), the bits of
    the dense path on a model holding those weights; exact-mode passes never run it. (Where the dense copy
    never pays, AVX2 CPUs running qmm, the mechanism is tested at 8 rows.)"""
    model = tiny_llama(layers=3, hidden=64).to(torch.bfloat16)
    ids = torch.randint(0, 32, (60,), generator=torch.Generator().manual_seed(3))
    wide_rows = quant.wide_rows(fmt) or 8
    monkeypatch.setattr(quant, "wide_rows", lambda f: wide_rows)
    n = wide_rows + 4
    runners = {name: FastRunner(model, capacity=128, exact=False, weights=fmt, **opts)
               for name, opts in (("wide", {}), ("narrow", {"wide": False}))}
    wide_net = runners["wide"].net
    assert wide_net.wide_rows == wide_rows and runners["narrow"].net.wide_rows is None
    calls = []
    dense_layers, head, lin, step = wide_net._dense
    spy = lambda x, w, b=None: calls.append(x.shape[0]) or lin(x, w, b)  # noqa: E731
    wide_net._dense = (dense_layers, head, spy, functools.partial(layer_step, a=wide_net.arch, linear=spy))
    out = {}
    for name, r in runners.items():
        r.forward(ids[:20], last_only=True)
        out[name] = r.forward(ids[20:20 + n]).logits
    assert set(calls) == {20, 1, n}  # the prefill of 20 (its last row's logits) and the pass of n rows
    # the reference: the dense path of a model whose weights are the quantized ones' dequantization
    same = copy.deepcopy(model)
    net = runners["narrow"].net
    for i, layer in enumerate(same.model.layers):
        parts = {"wqkv": (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                 "wo": (layer.self_attn.o_proj,), "wgu": (layer.mlp.gate_proj, layer.mlp.up_proj),
                 "wdown": (layer.mlp.down_proj,)}
        for key, mods in parts.items():
            fused = torch.cat([m.weight.detach() for m in mods])
            w = quant.dequantized(fused, net.layers[i][key]).to(torch.bfloat16)
            for m, piece in zip(mods, w.split([m.out_features for m in mods])):
                m.weight = torch.nn.Parameter(piece.clone(), requires_grad=False)
    head = quant.dequantized(model.lm_head.weight.detach(), net.lm_head).to(torch.bfloat16)
    same.lm_head.weight = torch.nn.Parameter(head, requires_grad=False)
    ref = FastRunner(same, capacity=128, exact=False)
    ref.forward(ids[:20], last_only=True)
    assert torch.equal(out["wide"], ref.forward(ids[20:20 + n]).logits)
    assert not torch.equal(out["wide"], out["narrow"])  # other kernels ...
    torch.testing.assert_close(out["wide"], out["narrow"], atol=0.1, rtol=0.05)  # ... on the same weights
    calls.clear()
    assert runners["wide"].forward(ids[20 + n:20 + n + wide_rows - 1]).logits.shape[0] == wide_rows - 1 and not calls
    exact = FastRunner(model, capacity=128, exact=True, weights=fmt)
    exact.net._dense = wide_net._dense  # shared module: the same spy
    exact.forward(ids[:20], last_only=True)
    calls.clear()
    exact.forward(ids[20:20 + n])
    assert not calls  # exact mode: the quantized kernels at every row count


def test_auto_runs_the_files_4_bit_weights_where_qmm_runs(kernel):
    """"auto" on a quantized file in bfloat16 on CPU: q4 on qmm.py's kernel (the fastest measured), the dense
    bf16 weights on PyTorch's kernels; float32, or a model without a file, stays dense."""
    cpu = torch.device("cpu")
    want = "q4" if kernel == "qmm" else "bf16"
    assert quant.default_format() == want
    assert quant.resolve("auto", torch.bfloat16, cpu, from_file=True) == want
    assert quant.resolve("auto", torch.float32, cpu, from_file=True) == "bf16"
    assert quant.resolve(None, torch.bfloat16, cpu, from_file=False) == "bf16"
    assert quant.resolve("q8", torch.bfloat16, cpu, from_file=False) == "q8"
