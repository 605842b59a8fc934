// The kernel of verispec/fast/glu.py (its docstring says what it computes and why); built by verispec/fast/ops.py.
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
