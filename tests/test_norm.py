"""norm.py's RMSNorm kernel: LlamaRMSNorm's arithmetic and roundings, a row's bits independent of the other
rows and the threads, one clear error for bad input, and the switch that turns it off."""

from __future__ import annotations

import pytest
import torch

from verispec.fast import core, norm

pytestmark = pytest.mark.skipif(norm.available() is not None, reason=f"norm kernel: {norm.available()}")


def _rows(n: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, d, generator=g) * torch.exp(torch.randn(n, 1, generator=g))).to(dtype)
    w = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
    return x, w


def _llama(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, written out: float32 variance, cast, then the weight's product."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [8, 576, 1000])
def test_kernel_is_llamas_rms_norm(dtype, d):
    """Within one rounding of the float32 sum of squares of transformers' formula: float32 to a few ulps,
    bfloat16 / float16 equal but for rare one-ulp flips of the cast."""
    x, w = _rows(64, d, dtype)
    got = torch.ops.verispec.rms_norm(x, w, 1e-5)
    want = _llama(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    else:
        ulp = torch.finfo(dtype).eps * want.float().abs()
        differ = got != want
        assert differ.float().mean() < 0.01
        assert ((got.float() - want.float()).abs()[differ] <= 2 * ulp[differ] + 1e-30).all()
    # and the float64 truth: two roundings to the dtype (the cast, the product) and float32's own error
    xd = x.double()
    normed = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)
    truth = w.double() * normed
    eps = max(torch.finfo(dtype).eps, 1e-6)
    assert ((got.double() - truth).abs() <= 2 * eps * (w.double() * normed).abs() + 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_the_other_rows_or_threads(dtype):
    x, w = _rows(130, 576, dtype, seed=1)
    alone = torch.cat([torch.ops.verispec.rms_norm(x[i:i + 1], w, 1e-6) for i in range(130)])
    for n in (2, 7, 64, 65, 130):
        assert torch.equal(torch.ops.verispec.rms_norm(x[:n], w, 1e-6), alone[:n])
    assert torch.equal(torch.ops.verispec.rms_norm(x.reshape(10, 13, 576), w, 1e-6), alone.reshape(10, 13, 576))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(torch.ops.verispec.rms_norm(x, w, 1e-6), alone)
    finally:
        torch.set_num_threads(threads)


def test_the_fast_paths_norm_runs_it_on_the_cpu():
    x, w = _rows(3, 64, torch.bfloat16, seed=2)
    assert norm.runs_on(x)
    assert torch.equal(core.rms_norm(x, w, 1e-5, gemma=False), torch.ops.verispec.rms_norm(x, w, 1e-5))
    assert not norm.runs_on(x.to(torch.int32))


def test_bad_input_is_one_clear_error():
    x, w = _rows(3, 64, torch.float32)
    with pytest.raises(RuntimeError, match=r"rms_norm: x \[\.\.\., D\] and w \[D\] of x's dtype"):
        torch.ops.verispec.rms_norm(x, w[:32], 1e-5)
    with pytest.raises(RuntimeError, match="of x's dtype"):
        torch.ops.verispec.rms_norm(x, w.bfloat16(), 1e-5)


def test_verispec_norm_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("VERISPEC_NORM", "0")
    assert norm.OPERATOR.build() == "VERISPEC_NORM=0"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_residual_sum_and_its_norm_in_one_call(dtype):
    """add_rms_norm gives ATen's rounded sum x + o and exactly the norm kernel's bits of it, row by row."""
    x, w = _rows(40, 576, dtype, seed=4)
    o, _ = _rows(40, 576, dtype, seed=5)
    y, h = torch.ops.verispec.add_rms_norm(x, o, w, 1e-5)
    assert torch.equal(y, x + o)
    assert torch.equal(h, torch.ops.verispec.rms_norm(x + o, w, 1e-5))
    alone = [torch.ops.verispec.add_rms_norm(x[i:i + 1], o[i:i + 1], w, 1e-5) for i in range(40)]
    assert torch.equal(torch.cat([a for a, _ in alone]), y) and torch.equal(torch.cat([b for _, b in alone]), h)
    strided = torch.ops.verispec.add_rms_norm(x.t().contiguous().t(), o, w, 1e-5)  # a column-major x
    assert torch.equal(strided[0], y) and torch.equal(strided[1], h)
    assert all(torch.equal(a, b) for a, b in zip(core.add_rms_norm(x, o, w, 1e-5, gemma=False), (y, h)))
    with pytest.raises(RuntimeError, match="add_rms_norm: x and o"):
        torch.ops.verispec.add_rms_norm(x, o[:3], w, 1e-5)
