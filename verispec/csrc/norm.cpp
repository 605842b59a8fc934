// The kernel of verispec/fast/norm.py (its docstring says what it computes and why); built by verispec/fast/ops.py.
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
