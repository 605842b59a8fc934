"""Rotary embedding and the KV-cache write as one small CPU kernel.

Why. In a layer step, rotating queries and keys and writing keys and values into the cache was a dozen
ATen operations (two products, the roll, the sum, the concatenation, transposes, casts, index_copy_),
each a few microseconds of dispatch and allocation against well under a microsecond of arithmetic at
decode shapes; 30 layers make that a tenth of a one-position forward on a quantized model. Here one call
does it, with the same arithmetic and roundings per element as those operations:

    r = cast(cast(x * cos) + cast(roll(x, hd / 2) * sin))     (x: a query or key head, in the model dtype;
                                                                 sin's first half negated: core.rope_tables)
    queries -> [H, T, hd] in the cache dtype (returned); keys r and values v -> cache[:, slot]

so its bits equal the operations' (tests/test_rope.py), and a row's result depends only on the row.
The Python step (core.py) and the native step (native.py) both call it where it runs. Its C++ is
verispec/csrc/rope.cpp, built by ops.py's loader for the CPU's x86-64 level without floating-point contraction (a contracted x * cos + y * sin would round once, not
three times); where it does not build, or VERISPEC_ROPE=0, the operations run.
"""

from __future__ import annotations

import torch

from verispec.fast import ops

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


OPERATOR = ops.Operator("rope_store", "VERISPEC_ROPE", "rope.cpp", "rotary embedding and the cache write run as ATen operations",
                        lambda: ops.for_cpu(contract=False))


def available() -> str | None:
    """None where the kernel runs here, else why not (logged once)."""
    return OPERATOR.available()


def runs_on(qk: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether the kernel takes these inputs (CPU, float dtypes, tables in qk's dtype, kernel built; not inside
    torch.compile, which fuses the operations itself). native.py's C++ decides the same way."""
    if torch.compiler.is_compiling():
        return False
    return (qk.device.type == "cpu" and qk.dtype in DTYPES and kv.dtype in DTYPES and cos.dtype == qk.dtype
            and available() is None)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin as ATen operations (sin from core.rope_tables: first half negated)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def rotate_store(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                 slots: torch.Tensor) -> torch.Tensor:
    """Rotate queries and keys qk [T, H + KVH, hd], write the keys and v [T, KVH, hd] into kv [2 KVH, S, hd]
    at `slots` -> the rotated queries [H, T, hd] in kv's dtype: the kernel where it runs, else the operations."""
    if runs_on(qk, kv, cos) and qk.stride(-1) == 1 and v.stride(-1) == 1:
        return torch.ops.verispec.rope_store(qk, v, cos, sin, kv, slots)
    H = qk.shape[1] - v.shape[1]
    r = rotate(qk, cos, sin)
    # the position is the pointer: keys and values land in their slots in one copy, nothing is concatenated
    # onto the cache or reallocated
    kv.index_copy_(1, slots, torch.cat((r[:, H:], v), dim=1).transpose(0, 1).to(kv.dtype))
    return r[:, :H].transpose(0, 1).to(kv.dtype)
