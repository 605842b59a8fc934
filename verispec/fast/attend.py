"""Exact mode's attention as one small CPU kernel: each query row sums over its keys in position order.

Why. canonical.py makes a row's attention independent of where its keys sit in the cache (a tree node
gets the bits plain decoding gets) with PyTorch's operations: a gather into position order, two or three
batched products and a per-row product over the last 128 columns. At decode shapes that is a dozen small
kernels per layer whose fixed costs are most of a one-position forward's time beyond the weight bytes
(`aten::bmm` alone ~30 us a call, ~3 ms a forward for SmolLM2-135M). Here one call does a layer's
attention, and the layout independence holds by construction, for any tree depth and attended length:

    for a query row t of head h (kv head h // g) and each canonical column c = 0 .. L - 1 the row may see
    (bias[t, c] = 0), in order of c:
        s_c = dot(q[h, t], k[slot]) * scale       slot = order[t, c] (a tree row's ancestors) or c
    m = max s_c;  p_c = exp(s_c - m);  out = (sum_c p_c * v[slot]) / (sum_c p_c)

Every dot product runs over head_dim in the same 16-lane order, sums run over the columns in position
order, and a row is computed by one thread, so the bits of a row depend only on its own query and the
keys and values at the positions it sees: not on the slots, the other rows, L, or the thread count
(tests/test_attend.py; the load-time row-invariance probe still runs it). exp is a fixed polynomial
(Cephes' expf coefficients) on GCC vector extensions, the 16 lanes held as vectors of the target's own
width (see verispec/csrc/attend.cpp, its C++), and a block of 16 keys' dot products is reduced together by one fixed tree. Built for the CPU's x86-64 level (v4: AVX-512,
v3: AVX2 + FMA, else baseline; the build is named after the level), so Zen 3 runs it too.

Float32 caches only (the CPU fast path keeps float32 caches for bfloat16 models); elsewhere (CUDA, float16
caches, no compiler, VERISPEC_ATTEND=0) canonical.py's PyTorch operations run. Registered as
torch.ops.verispec.attend so the native layer step calls it too; built by ops.py's loader on first use
(`python -m verispec.fast.build`, which setup.sh runs, builds it ahead).
"""

from __future__ import annotations

import torch

from verispec.fast import ops

MAX_HEAD_DIM = 256

OPERATOR = ops.Operator("attend", "VERISPEC_ATTEND", "attend.cpp", "exact-mode attention runs PyTorch's operations",
                        ops.for_cpu)


def available() -> str | None:
    """None where the kernel runs here, else why not (logged once)."""
    return OPERATOR.available()


def runs_on(t: torch.Tensor) -> bool:
    """Whether the kernel takes attention over caches like t (float32 on the CPU, head_dim <= 256, kernel built)."""
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.shape[-1] <= MAX_HEAD_DIM and available() is None


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, bias: torch.Tensor, scale: float,
              order: torch.Tensor | None) -> torch.Tensor:
    """q [H, T, D]; caches [KVH, S, D]; bias [>= T, L] float32 over canonical columns (0 or -inf; rows t < T
    are read); order [T, L] canonical column -> slot, or None (the columns are the slots) -> [H, T, D]."""
    return torch.ops.verispec.attend(q, k_cache, v_cache, bias, NO_ORDER if order is None else order, scale)


NO_ORDER = torch.empty(0, dtype=torch.long)  # the kernel's "columns are slots"
