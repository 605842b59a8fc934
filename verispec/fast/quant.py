"""Quantized weights for the fast path on CPU: PyTorch's weight-only int8 and int4 kernels.

`--weights q8`: every projection and the LM head as int8 with one scale per output channel
(`torch._weight_int8pack_mm`), requantized from the model's float32 weights. `--weights q4`: 4-bit
groups of 32 along the input features with a scale and a zero per group
(`torch._weight_int4pack_mm_for_cpu`), which is the shape of GGUF's Q4_0 / Q4_1 blocks and of Q4_K's
sub-blocks, so a GGUF's own blocks map onto it (models/gguf_weights.py reads them); a weight without
such blocks (a Q5_0, Q6_K or Q8_0 tensor) runs as int8: requantizing a 5- to 8-bit tensor to 4 bits
would lose more than the file did. A model that is not a GGUF is requantized to 4-bit min/max groups
(the Q4_1 recipe).

The kernels' conventions (checked on torch 2.13 against an identity input): int4 dequantizes
w = (q - 8) * scale + zero with q in 0..15, and int8 w = q * scale; scales and zeros must have the
activations' dtype. So a Q4_1 block w = d * q + m maps to scale = d, zero = m + 8 d, exactly but for
the rounding of d and m + 8 d to bfloat16 (`effective()` gives the float32 weight a kernel multiplies
by; tests/test_quant.py bounds its distance to the GGUF's float32 dequantization). Activations stay
in bfloat16: the int4 kernel is far slower with float32 ones (docs/performance-notes.md).

Where qmm.py's kernel runs (AVX-512 VNNI, or AVX2 with FMA and F16C), both formats run it instead (the
same groups with their float16 scales, activations rounded to 8 bits per group, cost growing slowly with
the rows, bits independent of the rows); elsewhere PyTorch's kernels above. `available(fmt)` probes that
the kernel `prepare` chooses exists and computes what its convention says; where not, the decoder falls
back to the dense weights and says so (decoder.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch

from verispec.fast import packed, qmm

log = logging.getLogger(__name__)

FORMATS = ("bf16", "q8", "q4")
GROUP = 32  # GGUF's Q4_0 / Q4_1 block and Q4_K sub-block length, and an int4 kernel group size


@dataclass
class Groups:
    """4-bit groups of GROUP weights along the input features: w = d * q + m (GGUF's Q4_1 form; Q4_0
    is m = -8 d). q [N, K] uint8 in 0..15, d and m [N, K / GROUP] float32."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    def dense(self) -> torch.Tensor:
        """The float32 weight the groups stand for, computed as the GGUF dequantization does (d * q
        exact in float32, one rounding of the sum)."""
        d = self.d.repeat_interleave(GROUP, dim=1)
        m = self.m.repeat_interleave(GROUP, dim=1)
        return d * self.q.float() + m

    @staticmethod
    def cat(parts: list["Groups"]) -> "Groups":
        return Groups(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "d", "m")))


class Int4(NamedTuple):
    packed: torch.Tensor   # the int4pack layout of torch._convert_weight_to_int4pack_for_cpu
    sz: torch.Tensor       # [K / GROUP, N, 2]: scale, zero


class Int8(NamedTuple):
    q: torch.Tensor        # [N, K] int8
    scale: torch.Tensor    # [N]


def requantize_groups(w: torch.Tensor) -> Groups:
    """Dense [N, K] -> 4-bit min/max groups (the Q4_1 recipe), for weights that come without blocks."""
    g = w.float().reshape(w.shape[0], -1, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    d = ((hi - lo) / 15).half().float()  # float16 scales, as a GGUF stores them
    lo = lo.half().float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = ((g - lo[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(w.shape)
    return Groups(q, d, lo)


def to_int4(g: Groups, dtype: torch.dtype) -> Int4:
    """Groups -> the int4 kernel's weight: scale = d, zero = m + 8 d (w = (q - 8) * scale + zero)."""
    packed = torch._convert_weight_to_int4pack_for_cpu(g.q.to(torch.int32).contiguous(), 1)
    # m + 8 d in float64 is exact (two float32 values a power of two apart in scale), rounded once
    zero = (g.m.double() + 8 * g.d.double()).to(dtype)
    sz = torch.stack((g.d.to(dtype), zero), dim=-1).transpose(0, 1).contiguous()
    return Int4(packed, sz)


def to_int8(w: torch.Tensor, dtype: torch.dtype) -> Int8:
    """Dense [N, K] -> int8 per output channel, the scale rounded UP to `dtype` so that max|w| / scale
    stays within 127 and every weight within half a step."""
    w = w.float()
    s = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    sd = s.to(dtype)
    low = sd.float() < s
    sd[low] = torch.nextafter(sd[low], torch.full_like(sd[low], float("inf")))
    q = (w / sd.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    return Int8(q.contiguous(), sd)


def int4_fits(n: int, k: int) -> bool:
    """The int4 kernel takes N a multiple of 16 and whole groups of K."""
    return n % 16 == 0 and k % GROUP == 0


def effective(w: Int4 | Int8, groups: Groups | None = None) -> torch.Tensor:
    """The float32 [N, K] weight a quantized kernel multiplies by (for Int4, `groups` gives its q)."""
    if isinstance(w, Int8):
        return w.q.float() * w.scale.float()[:, None]
    s = w.sz[..., 0].float().T.repeat_interleave(GROUP, dim=1)
    z = w.sz[..., 1].float().T.repeat_interleave(GROUP, dim=1)
    return (groups.q.float() - 8) * s + z


def prepare(src: torch.Tensor | Groups, fmt: str, dtype: torch.dtype) -> Int4 | Int8 | qmm.QWeight:
    """One weight for format `fmt`: Groups (a GGUF's 4-bit blocks) or a dense tensor (float32 where the
    model was dequantized from a file: requantizing rounded bfloat16 values would add an error). On
    qmm.py's kernel where it runs here and the shape fits, else on PyTorch's."""
    n, k = src.q.shape if isinstance(src, Groups) else src.shape
    four = fmt == "q4" and int4_fits(n, k)
    if four:
        g = src if isinstance(src, Groups) else requantize_groups(src)
        return qmm.pack4(g.q, g.d, g.m) if _qmm_fits(n, k) else to_int4(g, dtype)
    w8 = to_int8(src.dense() if isinstance(src, Groups) else src, dtype)
    return qmm.pack8(w8.q, w8.scale) if _qmm_fits(n, k) else w8


def _use_qmm() -> bool:
    """Whether quantized weights run qmm.py's kernel here (the one switch: tests turn it off)."""
    return qmm.available() is None


def _qmm_fits(n: int, k: int) -> bool:
    return qmm.fits(n, k) and _use_qmm()


def is_int4(w: Int4 | Int8 | qmm.QWeight) -> bool:
    return isinstance(w, Int4) or (isinstance(w, qmm.QWeight) and w.int4)


def shape(w: Int4 | Int8 | qmm.QWeight) -> tuple[int, int]:
    """(N, K) of a prepared weight."""
    if isinstance(w, qmm.QWeight):
        return w.w.shape[0] * qmm.BLOCK, w.w.shape[1] * GROUP
    if isinstance(w, Int4):
        return w.sz.shape[1], w.sz.shape[0] * GROUP
    return tuple(w.q.shape)


def dequantized(src: torch.Tensor | Groups, w: Int4 | Int8 | qmm.QWeight) -> torch.Tensor:
    """The float32 [N, K] weight `w` multiplies by, where `w` = prepare(src, ...)."""
    if isinstance(w, qmm.QWeight):
        return qmm.dense(w)
    if isinstance(w, Int8):
        return effective(w)
    return effective(w, src if isinstance(src, Groups) else requantize_groups(src))


def linear(x: torch.Tensor, w: Int4 | Int8 | qmm.QWeight, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] on the kernel of w's format."""
    if isinstance(w, qmm.QWeight):
        y = qmm.linear(x, w)
    elif isinstance(w, Int4):
        y = torch._weight_int4pack_mm_for_cpu(x, w.packed, GROUP, w.sz)
    else:
        y = torch._weight_int8pack_mm(x, w.q, w.scale)
    return y if b is None else y + b


def available(fmt: str, dtype: torch.dtype, device: torch.device) -> str | None:
    """None where format `fmt` can run (CPU, bfloat16 activations, the kernel present and computing
    its convention on a probe), else why not."""
    if torch.device(device).type != "cpu":
        return f"{fmt} weights run on CPU kernels only (device {torch.device(device).type})"
    if dtype != torch.bfloat16:
        return f"{fmt} weights need bfloat16 activations (--dtype bfloat16), not {str(dtype).replace('torch.', '')}"
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(32, 64, generator=g)
        x = torch.randn(5, 64, generator=g).to(dtype)
        qw = prepare(w, fmt, dtype)  # the kernel the model's weights will run
        # qmm's convention includes the activations' 8-bit groups
        want = qmm.reference(x, qw) if isinstance(qw, qmm.QWeight) else x.float() @ dequantized(w, qw).T
        got = linear(x, qw).float()
        if not torch.allclose(got, want.float(), atol=0.05, rtol=0.02):
            return f"the {fmt} kernel disagrees with its own convention on a probe"
    except (RuntimeError, AttributeError) as exc:
        return f"the {fmt} kernel is missing in this torch build ({str(exc).splitlines()[0][:80]})"
    return None


def resolve(weights: str | None, dtype: torch.dtype, device: torch.device, from_file: bool) -> str:
    """The format `weights` names; "auto" / None: "bf16" (dense) unless the model came from a quantized
    file (a weight source) and runs in bfloat16 on CPU, where default_format() (what the measurements chose)."""
    if weights not in (None, "auto"):
        if weights not in FORMATS:
            from verispec.errors import InvalidParameter

            raise InvalidParameter(f"unknown weights '{weights}'; use one of auto, {', '.join(FORMATS)}")
        return weights
    fmt = default_format()
    if not from_file or fmt == "bf16" or available(fmt, dtype, device) is not None:
        return "bf16"
    return fmt


def target_format(target) -> str:
    """The weights format a loaded target's fast path runs (its `weights`, "auto" resolved): what its engines
    and the drafters on its features follow."""
    return resolve(getattr(target, "weights", "auto"), target.dtype, target.device,
                   getattr(target, "weight_source", None) is not None)


# Passes of at least this many rows run a dense copy of the quantized weights (their dequantization rounded
# to bfloat16, packed as the bf16 format packs its weights), where the dense GEMM costs less than the
# quantized kernel, whose cost grows with the rows while the dense one stays flat to 32 rows. PyTorch's
# kernels dequantize every weight again for each small block of rows (results/xeon/kernels/fast_decode_weights_amx_1thread.json:
# q4 below bf16 at 4 positions, even at 8; q8 below at 4, above at 8); qmm.py's grow more slowly (its
# integer dot products at ~1 per cycle; results/xeon/kernels/native_step_qmm_amx_1thread.json: q4 below bf16 at 8,
# above at 16; q8 about even at 8). b8521ea:benchmarks/wide_rows.py measures the crossover directly. Only passes
# whose rows may round otherwise than plain decoding's run it: prefill, and every pass outside exact mode
# (decoder.py).
WIDE_ROWS = {"q8": 6, "q4": 8}
WIDE_ROWS_QMM = {"q8": 8, "q4": 16}


def wide_rows(fmt: str) -> int | None:
    """The row count from which format `fmt`'s passes may run the dense copy (None: never). Never where
    qmm runs and the CPU has no bf16 instructions (AVX2): the dense copy is packed.py's bf16 hybrid there,
    slower than qmm at every row count, a 256-token prefill included (results/zen3/kernels/wide_rows_avx2_zen3_1thread.json)."""
    if _use_qmm() and not packed.available(torch.bfloat16, torch.device("cpu")):
        return None
    return (WIDE_ROWS_QMM if _use_qmm() else WIDE_ROWS).get(fmt)


# what "auto" runs for a quantized file, chosen by benchmarks/fast_decode.py --weights side by side
# (results/*/kernels/fast_decode_weights_*.json): on qmm.py's kernel q4 decodes ~2.8x faster than the dense bf16
# weights and its 8-position verification still costs less than bf16's, so the file's own 4-bit weights are
# the default there (on AVX2 CPUs too, where bf16 has no instructions of its own and q4 decodes ~5x faster:
# results/zen3/kernels/native_step_qmm_avx2_zen3_1thread.json); PyTorch's int4 / int8 kernels cost time per row
# (docs/performance-notes.md): q4 wins plain decoding of short prompts but loses speculation's wider passes
# to the dense packed weights, which stay the default on CPUs without qmm (no AVX2)
def default_format() -> str:
    return "q4" if _use_qmm() else "bf16"
