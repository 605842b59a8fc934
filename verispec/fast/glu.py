"""The SiLU-gated MLP's middle, silu(gate) * up, as one small CPU kernel.

Why. In a layer step the gate/up projection returns [T, 2I]; splitting it, SiLU and the product were four
ATen calls with their dispatch and two allocations, a few microseconds each against well under one of
arithmetic at decode shapes, in each of a model's layers. Here one call reads gate and up and writes the
product, with ATen's arithmetic and roundings per element:

    s = cast(x / (1 + exp(-x)))   in float32, x = float(gate); exp is SLEEF's expf (u10), which ATen's
                                  vectorised SiLU calls, where ATen vectorises, and libm's expf on the
                                  elements ATen leaves to its scalar loop (a row's last I mod 2V, V the
                                  width of ATen's vector of the dtype on this CPU)
    out = cast(float(s) * float(up))

so its bits equal `F.silu(gate) * up` (tests/test_glu.py; NaN payloads aside), and a row's result depends
only on the row. The Python step (core.py) and the native step (native.py) both call it where it runs.
Its C++ is verispec/csrc/glu.cpp, built by ops.py's loader for the CPU's x86-64 level without floating-point contraction, for ATen's own vector width (AVX2 or
AVX-512, as torch.backends.cpu reports it); elsewhere, or with VERISPEC_GLU=0, the ATen operations run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from verispec.fast import ops

DTYPES = (torch.float32, torch.bfloat16)
_LEVEL = {"AVX2": "x86-64-v3", "AVX512": "x86-64-v4"}  # the ATen capabilities whose vector code is mirrored


def _flags() -> ops.Flags | str:
    """The build for ATen's vector width on this CPU (named after it), or why ATen's kernels are not mirrored."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in _LEVEL or ops.x86_level() == "x86-64" or (cap == "AVX512" and ops.x86_level() != "x86-64-v4"):
        return f"ATen runs its {cap} kernels here; the SiLU kernel mirrors only its AVX2 and AVX-512 ones"
    return ops.Flags(("-O3", f"-march={_LEVEL[cap]}", "-ffp-contract=off", f"-DCPU_CAPABILITY={cap}",
                      f"-DCPU_CAPABILITY_{cap}"), cap.lower())


OPERATOR = ops.Operator("silu_mul", "VERISPEC_GLU", "glu.cpp", "the gated MLP's SiLU and product run as ATen operations",
                        _flags)


def available() -> str | None:
    """None where the kernel runs here, else why not (logged once)."""
    return OPERATOR.available()


def is_silu(act) -> bool:
    """Whether an Arch's activation is SiLU (F.silu, or transformers' ACT2FN["silu"].forward)."""
    return act is F.silu or type(getattr(act, "__self__", None)).__name__ in ("SiLUActivation", "SiLU")


def runs_on(gu: torch.Tensor) -> bool:
    """Whether the kernel takes this input (CPU, float32 / bfloat16, rows contiguous, kernel built; not inside
    torch.compile, which fuses the operations itself). native.py's C++ decides the same way."""
    if torch.compiler.is_compiling():
        return False
    return gu.device.type == "cpu" and gu.dtype in DTYPES and gu.stride(-1) == 1 and available() is None


def gated(gu: torch.Tensor, act) -> torch.Tensor:
    """act(gate) * up of gu [T, 2I] (gate then up) -> [T, I]: the kernel where act is SiLU and it runs,
    else the operations."""
    if is_silu(act) and runs_on(gu):
        return torch.ops.verispec.silu_mul(gu)
    gate, up = gu.chunk(2, dim=-1)
    return act(gate) * up
