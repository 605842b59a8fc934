"""4- and 8-bit weights times int8 activations with exact integer dot products (AVX-512 VNNI or AVX2).

Why. PyTorch's weight-only int4 / int8 CPU kernels read quantized weights fast at one row, but they
dequantize every weight again for each small block of rows, so a pass over 8 or 16 positions (a
speculative verification) costs 2-4x a one-position pass, and speculation on quantized weights stops
paying. Here every weight is expanded once per pass whatever the rows, and the products are integer:

    w[n, k] = d[n, g] * q[n, k] + c[n, g]          (g = k // 32: GGUF's Q4_1 block / Q4_K sub-block form,
                                                    q in 0..15; int8 weights: q in -127..127, d per
                                                    channel, c = 0)
    x[m, k] ~ dx[m, g] * x8[m, k]                  (x8 = round(x / dx) in -127..127, dx = max|x| / 127 per
                                                    group of 32: llama.cpp's Q8 activation blocks)
    y[m, n] = sum over g of  d * dx * I + c * dx * S,   I = sum_k q * x8,  S = sum_k x8  (int32, exact)

`vpdpbusd` computes I exactly, 64 products per instruction (AVX-512 VNNI; on AVX2 CPUs such as Zen 3,
`vpmaddubsw` + `vpmaddwd`, 32 products, no sum saturating: see the AVX2 section of verispec/csrc/qmm.cpp); the float
part runs in the same fixed order per output (group by group) on both, so both give the same bits
(tests/test_qmm.py checks the kernel against its float32 operations written out). A row's result thus
never depends on the other rows of the pass, the number of rows or the threads: exact mode's row
invariance holds by construction (the load-time probe still checks it). The weights keep the file's own
scales; the cost is the activations' rounding to 8 bits per 32-group, which llama.cpp's Q4/Q8 dot
products also do (the error bound is tested in tests/test_qmm.py).

Layout (`pack4`, `pack8`): per block of 16 output channels and group, 8 lines of 64 bytes, line j holding
for each of the 16 channels the 4 weights k = 4j .. 4j + 3 (the `vpdpbusd` lane order); 4-bit weights put
line 2i in the low and line 2i + 1 in the high nibbles of 4 lines, with d and c in float16 per channel and
group (a GGUF Q4_0 / Q4_1 block's own scales exactly; Q4_K's products d * scale are rounded to float16).
8-bit weights are stored as q + 128 (the kernel's unsigned operand), so sum_k (q + 128) x8 - 128 S = I
exactly, with one float32 scale per channel.

The work per pass: the activations' 8-bit groups once (vectorised; bfloat16 activations are read and the
outputs rounded to bfloat16 in the kernel, so a bfloat16 model's projection is one call without casts),
then per block of 16 channels the rows in micro-kernels of up to 8 rows whose accumulators stay in
registers, each weight group expanded once for those rows. At 8 rows the integer products share the vector
ports with the float part of each group (convert, scale, two FMAs per row), so that part is kept minimal
(dx * S is computed once per row and group, not per block). An AMX tile version was tried: its products
are exact integers too (same bits), but one tile product per group of 32 and its store cost more than the
VNNI instructions below 16 rows, so it is not kept. The AVX2 rows ask for the weight stream a few groups
ahead (software prefetch): a projection's weights are too short a stream for the hardware prefetcher. The
AVX-512 rows do so at 8 rows only (on Zen 4 the hardware keeps up with fewer rows, and asking costs there).

The C++ is verispec/csrc/qmm.cpp, built on first use by ops.py's loader (`python -m verispec.fast.build`
builds it ahead; registered as torch.ops.verispec.qmm so that the native layer step can call it too), one
build holding both instruction sets, chosen per process by the CPU;
`available()` says why not where the CPU has neither or the build fails, and quant.py keeps PyTorch's
kernels there.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from verispec.fast import ops

GROUP = 32
BLOCK = 16  # output channels per 512-bit lane set


class QWeight(NamedTuple):
    """A weight packed for `linear` (see the module docstring for the layout)."""

    w: torch.Tensor    # [N / 16, K / 32, 256 (4-bit) or 512 (8-bit)] uint8
    sc: torch.Tensor   # 4-bit: [N / 16, K / 32, 2, 16] float16 (d, c); 8-bit: [N / 16, 16] float32

    @property
    def int4(self) -> bool:
        return self.w.shape[2] == 4 * 64


def _flags() -> ops.Flags | str:
    """One build holding both instruction sets (the kernel picks per process), or why the CPU runs neither."""
    flags = ops.cpu_flags()
    if not ({"avx512f", "avx512bw", "avx512_vnni"} <= flags or {"avx2", "fma", "f16c"} <= flags):
        return "the CPU lacks AVX2 with FMA and F16C (and AVX-512 VNNI)"
    return ops.Flags(("-O3",))


OPERATOR = ops.Operator("qmm", "VERISPEC_QMM", "qmm.cpp", "quantized weights run PyTorch's kernels", _flags)


def available() -> str | None:
    """None where the kernel runs here, else why not (logged once)."""
    return OPERATOR.available()


def _lanes(t: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N / 16, K / 32, 8, 16, 4]: per block, group and line, the lane-ordered bytes."""
    n, k = t.shape
    return t.reshape(n // BLOCK, BLOCK, k // GROUP, 8, 4).permute(0, 2, 3, 1, 4)


def fits(n: int, k: int) -> bool:
    return n % BLOCK == 0 and k % GROUP == 0


def pack4(q: torch.Tensor, d: torch.Tensor, c: torch.Tensor) -> QWeight:
    """4-bit groups w = d * q + c (q [N, K] in 0..15, d and c [N, K / 32], rounded to float16: a GGUF
    Q4_0 / Q4_1 block's own scales exactly)."""
    lanes = _lanes(q.to(torch.uint8))
    lines = lanes[:, :, 0::2] | (lanes[:, :, 1::2] << 4)  # lines 2i (low nibbles) and 2i + 1 (high)
    w = lines.reshape(lanes.shape[0], lanes.shape[1], 4 * 64).contiguous()
    n, g = d.shape
    sc = torch.stack([v.half().reshape(n // BLOCK, BLOCK, g).permute(0, 2, 1) for v in (d, c)], dim=2)
    return QWeight(w, sc.contiguous())


def pack8(q: torch.Tensor, scale: torch.Tensor) -> QWeight:
    """8-bit weights w = scale[n] * q (q [N, K] int8 in -127..127, scale [N]), stored as q + 128."""
    n, k = q.shape
    u = (q.to(torch.int16) + 128).to(torch.uint8)
    w = _lanes(u).reshape(n // BLOCK, k // GROUP, 8 * 64).contiguous()
    return QWeight(w, scale.float().reshape(n // BLOCK, BLOCK).contiguous())


def linear(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype."""
    return torch.ops.verispec.qmm(x, w.w, w.sc)


def reference(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """The kernel's arithmetic in float64 (for the tests): x rounded to its 8-bit groups as the kernel
    rounds it, times the weight the packing holds."""
    m, k = x.shape
    xf = x.float().reshape(m, k // GROUP, GROUP)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    x8 = (xf * inv).round().clamp(-127, 127)
    return ((x8.double() * (amax / 127).double()).reshape(m, k)) @ dense(w).double().T


def unpack(w: QWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The integers and scales a packed weight holds: q [N, K] (0..15, or -127..127 for 8 bits) and d, c
    [N, K / 32] float32 with w = d * q + c (8 bits: d the channel's scale repeated, c = 0)."""
    nb, g, _ = w.w.shape
    raw = w.w.reshape(nb, g, -1, BLOCK, 4)
    if w.int4:
        q = torch.stack((raw & 0x0F, raw >> 4), dim=3).reshape(nb, g, 8, BLOCK, 4).float()
    else:
        q = raw.float() - 128
    q = q.permute(0, 3, 1, 2, 4).reshape(nb * BLOCK, g * GROUP)  # [N, K]
    if not w.int4:
        d = w.sc.reshape(-1, 1).expand(-1, g)
        return q, d, torch.zeros_like(d)
    d, c = (w.sc[:, :, i].float().permute(0, 2, 1).reshape(nb * BLOCK, g) for i in (0, 1))
    return q, d, c


def dense(w: QWeight) -> torch.Tensor:
    """The float32 [N, K] weight a packed weight stands for."""
    q, d, c = unpack(w)
    if not w.int4:
        return d[:, :1] * q
    return d.repeat_interleave(GROUP, 1) * q + c.repeat_interleave(GROUP, 1)
