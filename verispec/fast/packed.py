"""Weights prepacked for oneDNN's linear kernel on CPU: the GEMMs of a decode step at memory speed.

At batch 1 a decode step is a chain of GEMVs over the weights. On this project's CPU (AVX-512 with
bf16 dot products, no AMX) `F.linear` reads a weight from memory far below the rate the cores can
stream, and the same weight prepacked reads it much faster (figures: docs/performance-notes.md,
kept out of the code because they belong to one machine and torch version). The packed
layout is oneDNN's blocked layout, chosen once at load (`torch.ops.mkldnn._reorder_linear_weight`,
the op inductor's CPU freezing pass uses) and run by `torch.ops.mkldnn._linear_pointwise`.

A packed weight is a copy in another layout: only this op can read it. Off CPU, in other dtypes, or
where the ops are missing or disagree with `F.linear` on a probe, the plain weight and `F.linear`
are used instead, so the fast path never depends on them.

bfloat16 on CPUs without bf16 instructions (AVX2 only, e.g. AMD Zen 3): oneDNN refuses to pack bf16
weights there, and `F.linear` in bfloat16 converts inside the GEMM, so its cost grows with the rows
(a forward over 16 positions costs many times one over one position, which leaves speculation nothing
to spend; docs/performance-notes.md). There each weight is kept twice: as it is, for one-row calls,
where bf16 `F.linear` reads half the bytes of float32 and is the fastest kernel; and packed WIDENED to
float32 (its values exactly: every bf16 number is a float32 number) for larger calls, which run the
float32 kernel on the bf16 activations and round the output to bf16: the same products summed in
float32, as a bf16 GEMM does. Exact mode's row-invariance probe sees the switch and keeps its passes at
HYBRID_ROWS rows or more. `VERISPEC_PACKED=0` turns this off too.
"""

from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn.functional as F

# the batch size oneDNN tunes the layout for: verification passes run a few to 8 rows (benchmarks/fast_decode.py)
PACK_BATCH = 8
# calls with fewer rows are padded to this many: oneDNN's 1- and 2-row kernels read a packed weight
# slower than its 4-row one (figures: docs/performance-notes.md), and a few more rows of arithmetic cost
# nothing there
MIN_ROWS = 4


def _raw_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] -> [M, out]; M below MIN_ROWS runs as MIN_ROWS rows (zero rows, thrown away), so a
    row's bits are those of the 4-row kernel whatever M is (row_invariance.py sees this function)."""
    m = x.shape[0]
    if m >= MIN_ROWS:
        return _raw_linear(x, w, b)
    return _raw_linear(F.pad(x, (0, 0, 0, MIN_ROWS - m)), w, b)[:m]


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """True where packed weights can be used: CPU, float32 or bfloat16, the oneDNN ops present and
    agreeing with F.linear on a probe. VERISPEC_PACKED=0 turns it off."""
    if os.environ.get("VERISPEC_PACKED", "1") == "0" or torch.device(device).type != "cpu":
        return False
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(40, 24, generator=g).to(dtype)
        x = torch.randn(3, 24, generator=g).to(dtype)
        got = _packed_linear(x, pack(w))
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        return bool(torch.allclose(got.float(), F.linear(x, w).float(), atol=tol, rtol=tol))
    except (RuntimeError, AttributeError):
        return False


def pack(w: torch.Tensor) -> torch.Tensor:
    """[out, in] weight -> the same weight in oneDNN's layout (a new tensor of the same size)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), PACK_BATCH)


# bf16 without bf16 instructions: calls of fewer rows than this run F.linear on the bf16 weight (the faster
# kernel at one row), larger ones the widened float32 copy (faster from two rows; docs/performance-notes.md)
HYBRID_ROWS = 2


def _pack_hybrid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [out, in] -> (the weight itself, a float32 copy in oneDNN's layout)."""
    w = w.detach().contiguous()
    return w, pack(w.float())


def _widened(x: torch.Tensor, w32: torch.Tensor, b: torch.Tensor | None, linear: Callable | None = None) -> torch.Tensor:
    """bf16 x [M, in] against the widened copy -> bf16 [M, out] (float32 products and sums, one rounding)."""
    return (linear or _packed_linear)(x.float(), w32, None if b is None else b.float()).to(x.dtype)


def _hybrid_linear(x: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor], b: torch.Tensor | None = None) -> torch.Tensor:
    if x.shape[0] < HYBRID_ROWS:
        return F.linear(x, w[0], b)
    return _widened(x, w[1], b)


@torch.library.custom_op("verispec::packed_linear", mutates_args=())
def _opaque_packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return _packed_linear(x, w, b)


@_opaque_packed_linear.register_fake
def _(x, w, b):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def for_compile(linear: Callable) -> Callable:
    """The linear to trace under torch.compile: inductor's own lowering of the oneDNN op expects weights
    it packed itself, so a packed weight goes through an opaque custom op that it calls as is."""
    if linear is _packed_linear:
        return lambda x, w, b=None: _opaque_packed_linear(x, w, b)
    if linear is _hybrid_linear:  # compiled passes run token buckets: one kernel, the widened one
        return lambda x, w, b=None: _widened(x, w[1], b, _opaque_packed_linear)
    return linear


def linear_for(dtype: torch.dtype, device: torch.device) -> tuple[Callable, Callable]:
    """(pack, linear): how to prepare a weight once and how to apply it, for this dtype and device."""
    if available(dtype, device):
        return pack, _packed_linear
    if dtype == torch.bfloat16 and available(torch.float32, device):
        return _pack_hybrid, _hybrid_linear  # no bf16 packing on this CPU (see the module docstring)
    return (lambda w: w), F.linear
