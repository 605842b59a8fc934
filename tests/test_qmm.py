"""qmm.py's kernel (4- and 8-bit weights times 8-bit activation groups, integer dot products): its packing
holds the weights it was given, it computes its stated arithmetic, and a row's bits depend neither on the
other rows of the pass nor on the threads (what exact mode needs from a kernel)."""

from __future__ import annotations

import pytest
import torch

from verispec.fast import qmm, quant

pytestmark = pytest.mark.skipif(qmm.available() is not None, reason=f"qmm kernel: {qmm.available()}")


def _weights(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g)) * 0.05
    groups = quant.requantize_groups(w)  # float16 d and m, as a GGUF Q4_1 file stores them
    w8 = quant.to_int8(w, torch.bfloat16)
    return groups, w8, qmm.pack4(groups.q, groups.d, groups.m), qmm.pack8(w8.q, w8.scale)


@pytest.mark.parametrize("n,k", [(16, 32), (96, 576), (64, 1536)])
def test_packing_holds_the_weights_exactly(n, k):
    groups, w8, p4, p8 = _weights(n, k)
    assert torch.equal(qmm.dense(p4), groups.dense())
    assert torch.equal(qmm.dense(p8), quant.effective(w8))
    assert p4.w.numel() == n * k // 2 and p8.w.numel() == n * k  # 4 and 8 bits a weight


@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_computes_its_arithmetic(bits):
    """float32 activations (no output rounding): the kernel equals the float64 evaluation of x's 8-bit
    groups times the packed weights up to float32 summation error; a zero row gives zeros."""
    _, _, p4, p8 = _weights(96, 576, seed=1)
    w = p4 if bits == 4 else p8
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(2))
    x[3] = 0
    got = qmm.linear(x, w).double()
    want = qmm.reference(x, w)
    scale = (x.abs() @ qmm.dense(w).abs().T).double()  # the size of the terms summed
    assert ((got - want).abs() <= 1e-5 * scale + 1e-6).all()
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    # and the 8-bit activation groups are close to x itself: within half a step of each group's max / 127
    exact = x.double() @ qmm.dense(w).double().T
    step = x.abs().reshape(7, -1, 32).amax(-1) / 127
    bound = (step.double().repeat_interleave(32, 1) / 2) @ qmm.dense(w).abs().double().T
    assert ((want - exact).abs() <= bound * (1 + 1e-6) + 1e-9).all()


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 a * b + c rounded once (the float32 product is exact in float64; the sum's float64 rounding
    could only matter where it lands on a float32 tie, which the seeds below do not hit)."""
    return (a.double() * b.double() + c.double()).float()


def _kernel_in_float32_steps(x: torch.Tensor, w: qmm.QWeight) -> torch.Tensor:
    """The float32 operations the kernel's docstring states, in its order, one rounding each: x's 8-bit
    groups, the exact integer sums I per group, then group by group acc += I * (d * dx) and acc += c * (dx * S)
    (8 bits: acc += I * dx, times the channel's scale at the end)."""
    m, k = x.shape
    xg = x.float().reshape(m, k // 32, 32)
    amax = xg.abs().amax(-1)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    x8 = (xg * inv[..., None]).round().clamp(-127, 127)
    dx, sums = amax / 127, x8.sum(-1)
    q, d, c = qmm.unpack(w)
    ints = torch.einsum("mgk,ngk->mng", x8.double(), q.reshape(q.shape[0], -1, 32).double()).float()  # exact
    acc = torch.zeros(m, q.shape[0])
    for g in range(k // 32):
        if w.int4:
            acc = _fma(ints[..., g], d[None, :, g] * dx[:, g, None], acc)
            acc = _fma(c[None, :, g].expand_as(acc), (dx[:, g] * sums[:, g])[:, None].expand_as(acc), acc)
        else:
            acc = _fma(ints[..., g], dx[:, g, None].expand_as(acc), acc)
    return acc if w.int4 else acc * d[None, :, 0]


@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_is_its_float32_steps_bit_for_bit(bits):
    """Both instruction sets' kernels (AVX-512 VNNI and AVX2, whichever this CPU runs) perform exactly the
    stated float32 operations in the stated order, so a model's bits do not depend on which one ran."""
    _, _, p4, p8 = _weights(64, 576, seed=7)
    w = p4 if bits == 4 else p8
    x = torch.randn(11, 576, generator=torch.Generator().manual_seed(8)) * 3
    assert torch.equal(qmm.linear(x, w), _kernel_in_float32_steps(x, w))


@pytest.mark.parametrize("bits", [4, 8])
def test_a_rows_bits_do_not_depend_on_the_pass_or_the_threads(bits):
    _, _, p4, p8 = _weights(160, 576, seed=3)
    w = p4 if bits == 4 else p8
    x = torch.randn(21, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    alone = torch.cat([qmm.linear(x[i:i + 1], w) for i in range(21)])
    for m in (2, 5, 8, 9, 16, 21):
        assert torch.equal(qmm.linear(x[:m], w), alone[:m])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(qmm.linear(x, w), alone)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("bits", [4, 8])
def test_bfloat16_in_and_out_is_the_float32_result_rounded_once(bits):
    """bfloat16 activations are read and the outputs rounded in the kernel: the same bits as widening the
    input to float32 and rounding the float32 output to bfloat16 (to nearest even), NaN included; rows of
    every remainder of the 8-row blocks (1 to 7) and whole blocks."""
    _, _, p4, p8 = _weights(48, 576, seed=5)
    w = p4 if bits == 4 else p8
    x = torch.randn(19, 576, generator=torch.Generator().manual_seed(6)).bfloat16()
    x[2, 7] = float("nan")
    for m in (1, 3, 7, 8, 19):
        got = qmm.linear(x[:m], w)
        want = qmm.linear(x[:m].float(), w).bfloat16()
        assert got.dtype == torch.bfloat16
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
    h = x[3:9].half()
    assert torch.equal(qmm.linear(h, w), qmm.linear(h.float(), w).half())


def test_quantized_formats_run_qmm_where_it_is_available():
    groups, _, _, _ = _weights(64, 128)
    assert isinstance(quant.prepare(groups, "q4", torch.bfloat16), qmm.QWeight)
    w = quant.prepare(torch.randn(64, 128), "q8", torch.bfloat16)
    assert isinstance(w, qmm.QWeight) and not w.int4
    odd = quant.prepare(torch.randn(40, 128), "q8", torch.bfloat16)  # 40 rows: not whole blocks of 16
    assert isinstance(odd, quant.Int8)


def test_a_bad_weight_is_one_clear_error():
    _, _, p4, _ = _weights(16, 64)
    with pytest.raises(RuntimeError, match="weight shape does not match"):
        qmm.linear(torch.randn(2, 96), p4)
