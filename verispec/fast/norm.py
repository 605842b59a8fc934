"""RMSNorm as one small CPU kernel (Llama's form: w * cast(x * rsqrt(mean(x^2) + eps))).

Why. `torch.rms_norm` is a composite: at decode shapes its half-dozen operations (pow, mean, add, rsqrt,
mul, the casts) cost ~20 us a call against well under 1 us of arithmetic for a 576-wide row, and a forward
of SmolLM2-135M runs 61 of them. Here one call does it, with the same arithmetic per element:

    in float32: ss = sum of x^2 over the row (16 lanes, element k into lane k % 16, in order, then a fixed
    halving tree); r = 1 / sqrt(ss / D + eps);  out = cast(w * cast(x * r))

so a row's bits depend only on the row (not on the other rows or the threads), as exact mode needs. It
rounds where transformers' LlamaRMSNorm rounds (the normalised row to the model's dtype, then the product
with the weight); only the order of the sum of squares is its own, so it may differ from torch.rms_norm
by an ulp of the float32 sum in rare rows.

The Python step (core.rms_norm) and the native step (native.py) both call it where it runs, so their bits
stay equal. Its C++ is verispec/csrc/norm.cpp, built by ops.py's loader for the CPU's x86-64 level
(ops.x86_level) without floating-point contraction; where it does not build, or VERISPEC_NORM=0, the
composite runs.
"""

from __future__ import annotations

import torch

from verispec.fast import ops

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


OPERATOR = ops.Operator("rms_norm", "VERISPEC_NORM", "norm.cpp", "RMSNorm runs torch.rms_norm",
                        lambda: ops.for_cpu(contract=False), registers=("rms_norm", "add_rms_norm"))


def available() -> str | None:
    """None where the kernel runs here, else why not (logged once)."""
    return OPERATOR.available()


def runs_on(x: torch.Tensor) -> bool:
    """Whether the kernel takes this input (on the CPU, a float dtype, kernel built; not inside torch.compile,
    which fuses the composite itself)."""
    if torch.compiler.is_compiling():
        return False
    return x.device.type == "cpu" and x.dtype in DTYPES and available() is None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: w * cast(x * rsqrt(mean(x^2) + eps)), the kernel where it runs, else the composite."""
    if runs_on(x) and w.dtype == x.dtype:
        return torch.ops.verispec.rms_norm(x, w, eps)
    return w * torch.rms_norm(x, x.shape[-1:], None, eps)


def add_rms_norm(x: torch.Tensor, o: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rms_norm(y, w)) of the residual sum y = x + o: one kernel call where it runs (the sum rounded to
    the dtype as ATen's add rounds it), else the add and rms_norm."""
    if runs_on(x) and w.dtype == x.dtype and o.dtype == x.dtype and o.shape == x.shape:
        return torch.ops.verispec.add_rms_norm(x, o, w, eps)
    y = x + o
    return y, rms_norm(y, w, eps)
