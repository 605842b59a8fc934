"""glu.py's silu(gate) * up kernel: ATen's bits (its vector part and its scalar tail), a row's bits
independent of the other rows and the threads, the layer step's operations unchanged, and the switch
that turns it off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from verispec.fast import glu

pytestmark = pytest.mark.skipif(glu.available() is not None, reason=f"silu_mul kernel: {glu.available()}")


def _gu(t: int, i: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 2 * i, generator=g) * 4
    x[0, :4] = torch.tensor([0.0, -0.0, 88.0, -104.0])  # exp's edges: 1, overflow to inf, underflow to 0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("i", [1536, 1537, 33, 8, 100])
def test_kernel_gives_atens_bits(dtype, i):
    """Equal to F.silu(gate) * up bit for bit, widths with and without ATen's scalar tail included."""
    for t in (1, 3, 17):
        gu = _gu(t, i, dtype, seed=t)
        got = torch.ops.verispec.silu_mul(gu)
        gate, up = gu.chunk(2, dim=-1)
        want = F.silu(gate) * up
        assert got.dtype == dtype and got.shape == (t, i)
        assert torch.equal(got, want), f"{(got != want).sum()} of {want.numel()} elements differ"


def test_strided_rows_and_leading_dims():
    """Rows of a wider tensor (a view, as a batch's slice) and [..., 2I] inputs give the same bits."""
    wide = _gu(6, 200, torch.bfloat16)
    view = wide[:, 100:300 + 100]  # [6, 300]: rows strided by 400, each row contiguous
    assert not view.is_contiguous()
    assert torch.equal(torch.ops.verispec.silu_mul(view), torch.ops.verispec.silu_mul(view.contiguous()))
    assert torch.equal(torch.ops.verispec.silu_mul(wide.reshape(2, 3, 400)),
                       torch.ops.verispec.silu_mul(wide).reshape(2, 3, 200))


def test_a_rows_bits_do_not_depend_on_the_other_rows_or_threads():
    gu = _gu(70, 1536, torch.bfloat16, seed=3)
    alone = torch.cat([torch.ops.verispec.silu_mul(gu[r:r + 1]) for r in range(70)])
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for rows in (5, 33, 70):
                assert torch.equal(torch.ops.verispec.silu_mul(gu[:rows]), alone[:rows])
    finally:
        torch.set_num_threads(threads)


def test_gated_takes_the_kernel_for_silu_only(monkeypatch):
    gu = _gu(4, 64, torch.bfloat16)
    calls = []
    kernel = torch.ops.verispec.silu_mul
    monkeypatch.setattr(glu, "runs_on", lambda x: calls.append(x.shape) or True)
    assert torch.equal(glu.gated(gu, F.silu), kernel(gu))
    assert calls == [gu.shape]
    gelu = F.gelu
    assert torch.equal(glu.gated(gu, gelu), gelu(gu[:, :64]) * gu[:, 64:])
    assert calls == [gu.shape]  # the kernel is SiLU's only
    assert glu.is_silu(F.silu) and not glu.is_silu(gelu)
    from transformers.activations import ACT2FN

    assert glu.is_silu(ACT2FN["silu"].forward) and not glu.is_silu(ACT2FN["gelu_pytorch_tanh"].forward)


def test_bad_input_and_the_switch(monkeypatch):
    with pytest.raises(RuntimeError, match="gu \\[..., 2I\\]"):
        torch.ops.verispec.silu_mul(torch.zeros(2, 5))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.verispec.silu_mul(torch.zeros(2, 4, dtype=torch.float64))
    monkeypatch.setenv("VERISPEC_GLU", "0")
    assert glu.OPERATOR.build() == "VERISPEC_GLU=0"
