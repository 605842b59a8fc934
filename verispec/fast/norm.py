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
stay equal. Built for the CPU's x86-64 level (ops.x86_level) without floating-point contraction; where it
does not build, or VERISPEC_NORM=0, the composite runs.
"""

from __future__ import annotations

import torch

from verispec.fast import ops

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <cmath>

namespace {

constexpr int W = 16;

// o non-null: the row normalised is y = cast(x + o) (the residual sum, written to y), else x itself
template <typename T>
void rows(const T* x, const T* o, T* y, const T* w, T* out, int64_t r0, int64_t r1, int64_t D, float eps) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * D;
    if (o != nullptr) {
      T* yr = y + r * D;
      const T* orow = o + r * D;
      for (int64_t k = 0; k < D; ++k) yr[k] = static_cast<T>(static_cast<float>(xr[k]) + static_cast<float>(orow[k]));
      xr = yr;
    }
    float lanes[W] = {};
    int64_t k = 0;
    for (; k + W <= D; k += W)  // element k into lane k % W, in order (a shape the compiler vectorises)
      for (int i = 0; i < W; ++i) {
        const float v = static_cast<float>(xr[k + i]);
        lanes[i] += v * v;
      }
    for (int i = 0; k + i < D; ++i) {
      const float v = static_cast<float>(xr[k + i]);
      lanes[i] += v * v;
    }
    for (int s = W / 2; s >= 1; s /= 2)
      for (int i = 0; i < s; ++i) lanes[i] += lanes[i + s];
    const float inv = 1.f / std::sqrt(lanes[0] / static_cast<float>(D) + eps);
    T* out_r = out + r * D;
    for (int64_t k = 0; k < D; ++k) {
      const T normed = static_cast<T>(static_cast<float>(xr[k]) * inv);  // the cast LlamaRMSNorm makes
      out_r[k] = static_cast<T>(static_cast<float>(w[k]) * static_cast<float>(normed));
    }
  }
}

// x [..., D], w [D] in x's dtype -> x's shape and dtype
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && w.size(0) == x.size(-1) && w.scalar_type() == x.scalar_type(),
              "rms_norm: x [..., D] and w [D] of x's dtype");
  at::Tensor xc = x.contiguous(), wc = w.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t D = x.size(-1), R = D ? xc.numel() / D : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const scalar_t* wp = wc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) { rows<scalar_t>(xp, nullptr, nullptr, wp, op, r0, r1, D, (float)eps); });
  });
  return out;
}

// x, o [..., D] of one dtype, w [D] -> (y = x + o, rms_norm(y, w)): a residual sum and the norm after it
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& o, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && w.size(0) == x.size(-1) && w.scalar_type() == x.scalar_type() &&
              o.sizes() == x.sizes() && o.scalar_type() == x.scalar_type(),
              "add_rms_norm: x and o [..., D] of one dtype, w [D] of that dtype");
  at::Tensor xc = x.contiguous(), oc = o.contiguous(), wc = w.contiguous();
  at::Tensor y = at::empty_like(xc), out = at::empty_like(xc);
  const int64_t D = x.size(-1), R = D ? xc.numel() / D : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const scalar_t* opp = oc.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    const scalar_t* wp = wc.data_ptr<scalar_t>();
    scalar_t* outp = out.data_ptr<scalar_t>();
    at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) { rows<scalar_t>(xp, opp, yp, wp, outp, r0, r1, D, (float)eps); });
  });
  return {y, out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(verispec, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor o, Tensor w, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(verispec, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
"""

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _load() -> str | None:
    ops.load_for_cpu("norm", _SOURCE, contract=False)
    return None


OPERATOR = ops.Operator("rms_norm", "VERISPEC_NORM", _load, "RMSNorm runs torch.rms_norm")


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
