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
Built for the CPU's x86-64 level without floating-point contraction, for ATen's own vector width (AVX2 or
AVX-512, as torch.backends.cpu reports it); elsewhere, or with VERISPEC_GLU=0, the ATen operations run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from verispec.fast import ops

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>  // the bfloat16 <-> float conversions' specialisations (vec.h only declares them)
#include <cmath>

namespace {

using at::vec::Vectorized;

// ATen's SiLU kernel, then its product, on one row: the vectorised loop takes 2 vectors per step from the
// row's start (at::vec's classes, built here for the capability ATen dispatches to, are ATen's own
// arithmetic: SLEEF's expf), the rest runs ATen's scalar expressions
template <typename T>
void row(const T* g, const T* u, T* o, int64_t I) {
  using V = Vectorized<T>;
  constexpr int64_t N = V::size();
  const int64_t vec = I / (2 * N) * (2 * N);
  int64_t j = 0;
  if constexpr (std::is_same_v<T, float>) {
    const V one(1.f);
    for (; j < vec; j += N) {
      const V x = V::loadu(g + j);
      (x / (one + x.neg().exp()) * V::loadu(u + j)).store(o + j);
    }
    for (; j < I; ++j) o[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
  } else {
    const Vectorized<float> one(1.f);
    for (; j < vec; j += N) {
      auto [x0, x1] = at::vec::convert_to_float<T>(V::loadu(g + j));
      const V s = at::vec::convert_from_float<T>(x0 / (one + x0.neg().exp()), x1 / (one + x1.neg().exp()));
      (s * V::loadu(u + j)).store(o + j);
    }
    for (; j < I; ++j) {
      const T s = static_cast<float>(g[j]) / (1.0f + std::exp(-static_cast<float>(g[j])));
      o[j] = s * u[j];
    }
  }
}

// gu [..., 2I] (gate then up; rows may be strided, each row contiguous) -> silu(gate) * up [..., I]
at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() >= 1 && gu.size(-1) % 2 == 0, "silu_mul: gu [..., 2I], gate then up");
  const auto t = gu.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16, "silu_mul: float32 or bfloat16");
  at::Tensor x = gu.reshape({-1, gu.size(-1)});
  if (x.stride(1) != 1) x = x.contiguous();
  const int64_t R = x.size(0), I = x.size(1) / 2;
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, gu.options());
  const int64_t stride = x.stride(0);
  auto run = [&](auto* xp, auto* op) {
    at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) row(xp + r * stride, xp + r * stride + I, op + r * I, I);
    });
  };
  if (t == at::kFloat)
    run(x.data_ptr<float>(), out.data_ptr<float>());
  else
    run(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(verispec, m) {
  m.def("silu_mul(Tensor gu) -> Tensor");
}

TORCH_LIBRARY_IMPL(verispec, CPU, m) {
  m.impl("silu_mul", &silu_mul);
}
"""

DTYPES = (torch.float32, torch.bfloat16)
_LEVEL = {"AVX2": "x86-64-v3", "AVX512": "x86-64-v4"}  # the ATen capabilities whose vector code is mirrored


def _load() -> str | None:
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in _LEVEL or ops.x86_level() == "x86-64" or (cap == "AVX512" and ops.x86_level() != "x86-64-v4"):
        return f"ATen runs its {cap} kernels here; the SiLU kernel mirrors only its AVX2 and AVX-512 ones"
    ops.load(f"verispec_glu_{cap.lower()}", _SOURCE,
             ["-O3", f"-march={_LEVEL[cap]}", "-ffp-contract=off", f"-DCPU_CAPABILITY={cap}", f"-DCPU_CAPABILITY_{cap}"])
    return None


OPERATOR = ops.Operator("silu_mul", "VERISPEC_GLU", _load, "the gated MLP's SiLU and product run as ATen operations")


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
