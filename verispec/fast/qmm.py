"""4- and 8-bit weights times int8 activations with exact integer dot products (AVX-512 VNNI).

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

`vpdpbusd` computes I exactly, 64 products per instruction; the float part runs in a fixed order per
output (group by group), so a row's result never depends on the other rows of the pass, the number of
rows or the threads: exact mode's row invariance holds by construction (the load-time probe still checks
it). The weights keep the file's own scales; the cost is the activations' rounding to 8 bits per 32-group,
which llama.cpp's Q4/Q8 dot products also do (the error bound is tested in tests/test_qmm.py).

Layout (`pack4`, `pack8`): per block of 16 output channels and group, 8 lines of 64 bytes, line j holding
for each of the 16 channels the 4 weights k = 4j .. 4j + 3 (the `vpdpbusd` lane order); 4-bit weights put
line 2i in the low and line 2i + 1 in the high nibbles of 4 lines, with d and c in float16 per channel and
group (a GGUF Q4_0 / Q4_1 block's own scales exactly; Q4_K's products d * scale are rounded to float16).
8-bit weights are stored as q + 128 (the kernel's unsigned operand), so sum_k (q + 128) x8 - 128 S = I
exactly, with one float32 scale per channel.

Built on first use with torch.utils.cpp_extension (registered as torch.ops.verispec.qmm so that the
native layer step can call it too); `available()` says why not where the CPU lacks AVX-512 VNNI or the
build fails, and quant.py keeps PyTorch's kernels there.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from verispec.fast import ops

GROUP = 32
BLOCK = 16  # output channels per 512-bit lane set

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>

namespace {

constexpr int64_t GROUP = 32, BLOCK = 16, MB = 8;

// x [M, K] float -> x8 [M, K] int8, dx [M, G] (its scale per group) and S [M, G] (sum of x8 per group)
void quantize(const float* x, int64_t M, int64_t K, int8_t* x8, float* dx, int32_t* S) {
  const int64_t G = K / GROUP;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const float* xs = x + m * K + g * GROUP;
      float amax = 0.f;
      for (int64_t k = 0; k < GROUP; ++k) amax = std::max(amax, std::fabs(xs[k]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      int8_t* out = x8 + m * K + g * GROUP;
      for (int64_t k = 0; k < GROUP; ++k) {
        const int32_t q = std::min(127, std::max(-127, (int32_t)std::nearbyint(xs[k] * inv)));
        sum += q;
        out[k] = (int8_t)q;
      }
      dx[m * G + g] = amax / 127.f;
      S[m * G + g] = sum;
    }
  }
}

// one block of 16 output channels for all rows. I4: 4-bit weights with float16 d and c per channel and
// group (SC [NB, G, 2, 16]); else 8-bit weights stored as q + 128 with a float32 scale per channel (SC [NB, 16])
template <bool I4>
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c")))
void block(int64_t nb, int64_t M, int64_t K, int64_t N, const uint8_t* W, const void* SC, const int8_t* X8,
           const float* DX, const int32_t* S, float* Y) {
  const int64_t G = K / GROUP;
  constexpr int64_t LINES = I4 ? 4 : 8;
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    const int64_t mb = std::min(MB, M - m0);
    __m512 acc[MB];
    for (int64_t i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const int64_t at = nb * G + g;
      const uint8_t* wg = W + at * LINES * 64;
      __m512i wv[8];
      __m512 dv, cv;
      if (I4) {
        for (int j = 0; j < 4; ++j) {
          const __m512i v = _mm512_loadu_si512(wg + 64 * j);
          wv[2 * j] = _mm512_and_si512(v, low);
          wv[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        const uint16_t* sc = static_cast<const uint16_t*>(SC) + at * 2 * BLOCK;
        dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
        cv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + BLOCK)));
      } else {
        for (int j = 0; j < 8; ++j) wv[j] = _mm512_loadu_si512(wg + 64 * j);
      }
      for (int64_t i = 0; i < mb; ++i) {
        const int64_t m = m0 + i;
        const int32_t* xq = reinterpret_cast<const int32_t*>(X8 + m * K + g * GROUP);
        __m512i a = _mm512_setzero_si512();
        for (int j = 0; j < 8; ++j) a = _mm512_dpbusd_epi32(a, wv[j], _mm512_set1_epi32(xq[j]));  // {1to16}
        const float dx = DX[m * G + g];
        if (I4) {  // sum_k (d q + c) dx x8 = d dx I + c dx S
          acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(dv, _mm512_set1_ps(dx)), acc[i]);
          acc[i] = _mm512_fmadd_ps(cv, _mm512_set1_ps(dx * (float)S[m * G + g]), acc[i]);
        } else {  // sum_k (q + 128) x8 - 128 S = I, exact; the channel's scale comes at the end
          a = _mm512_sub_epi32(a, _mm512_set1_epi32(128 * S[m * G + g]));
          acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(dx), acc[i]);
        }
      }
    }
    const __m512 scale = I4 ? _mm512_set1_ps(1.f) : _mm512_loadu_ps(static_cast<const float*>(SC) + nb * BLOCK);
    for (int64_t i = 0; i < mb; ++i)
      _mm512_storeu_ps(Y + (m0 + i) * N + nb * BLOCK, I4 ? acc[i] : _mm512_mul_ps(acc[i], scale));
  }
}

// x [M, K] (any float dtype) -> [M, N] in x's dtype. 4-bit: w [N / 16, K / 32, 256] uint8, sc [N / 16, K / 32,
// 2, 16] float16 (d, c); 8-bit: w [N / 16, K / 32, 512] uint8, sc [N / 16, 16] float32
at::Tensor qmm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sc) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "qmm: x [M, K], w [N/16, K/32, bytes]");
  const int64_t M = x.size(0), K = x.size(1), NB = w.size(0), N = NB * BLOCK, G = K / GROUP;
  const bool int4 = w.size(2) == 4 * 64;
  TORCH_CHECK(K % GROUP == 0 && w.size(1) == G && (int4 || w.size(2) == 8 * 64), "qmm: weight shape does not match x");
  TORCH_CHECK(sc.is_contiguous() && (int4 ? sc.scalar_type() == at::kHalf && sc.numel() == NB * G * 2 * BLOCK
                                          : sc.scalar_type() == at::kFloat && sc.numel() == NB * BLOCK),
              "qmm: scales do not match the weight");
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor x8 = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor dx = at::empty({M, G}, x.options().dtype(at::kFloat));
  at::Tensor S = at::empty({M, G}, x.options().dtype(at::kInt));
  quantize(xf.data_ptr<float>(), M, K, x8.data_ptr<int8_t>(), dx.data_ptr<float>(), S.data_ptr<int32_t>());
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const uint8_t* W = w.data_ptr<uint8_t>();
  const void* SC = sc.data_ptr();
  const int8_t* X8 = x8.data_ptr<int8_t>();
  const float* DX = dx.data_ptr<float>();
  const int32_t* SS = S.data_ptr<int32_t>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, NB, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb) {
      if (int4) block<true>(nb, M, K, N, W, SC, X8, DX, SS, Y);
      else block<false>(nb, M, K, N, W, SC, X8, DX, SS, Y);
    }
  });
  return y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY(verispec, m) {
  m.def("qmm(Tensor x, Tensor w, Tensor sc) -> Tensor");
}

TORCH_LIBRARY_IMPL(verispec, CPU, m) {
  m.impl("qmm", &qmm);
}
"""


class QWeight(NamedTuple):
    """A weight packed for `linear` (see the module docstring for the layout)."""

    w: torch.Tensor    # [N / 16, K / 32, 256 (4-bit) or 512 (8-bit)] uint8
    sc: torch.Tensor   # 4-bit: [N / 16, K / 32, 2, 16] float16 (d, c); 8-bit: [N / 16, 16] float32

    @property
    def int4(self) -> bool:
        return self.w.shape[2] == 4 * 64


def _load() -> str | None:
    missing = {"avx512f", "avx512bw", "avx512_vnni"} - ops.cpu_flags()
    if missing:
        return f"the CPU lacks {', '.join(sorted(missing))} (integer dot products)"
    ops.load("verispec_qmm", _SOURCE, ["-O3"])
    return None


OPERATOR = ops.Operator("qmm", "VERISPEC_QMM", _load, "quantized weights run PyTorch's kernels")


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


def dense(w: QWeight) -> torch.Tensor:
    """The float32 [N, K] weight a packed weight stands for."""
    nb, g, _ = w.w.shape
    raw = w.w.reshape(nb, g, -1, BLOCK, 4)
    if w.int4:
        q = torch.stack((raw & 0x0F, raw >> 4), dim=3).reshape(nb, g, 8, BLOCK, 4).float()
    else:
        q = raw.float() - 128
    q = q.permute(0, 3, 1, 2, 4).reshape(nb * BLOCK, g * GROUP)  # [N, K]
    if not w.int4:
        return w.sc.reshape(-1, 1) * q
    d, c = (w.sc[:, :, i].float().permute(0, 2, 1).reshape(nb * BLOCK, g).repeat_interleave(GROUP, 1) for i in (0, 1))
    return d * q + c
