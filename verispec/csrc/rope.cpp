// The kernel of verispec/fast/rope.py (its docstring says what it computes and why); built by verispec/fast/ops.py.
#include <torch/extension.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

namespace {

// rows t0..t1; qk [T, H + KVH, hd] and v [T, KVH, hd] strided by rows and heads (last dim contiguous),
// cos / sin [T, hd], kv [2 KVH, S, hd] contiguous, q [H, T, hd]
template <typename T, typename C>
void rows(const T* qk, int64_t q0, int64_t q1, const T* v, int64_t v0, int64_t v1, const T* cs, const T* sn,
          C* kv, int64_t S, const int64_t* slots, C* q, int64_t t0, int64_t t1, int64_t nt, int64_t H,
          int64_t KVH, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t t = t0; t < t1; ++t) {
    const T* c = cs + t * hd;
    const T* s = sn + t * hd;
    const int64_t slot = slots[t];
    for (int64_t h = 0; h < H + KVH; ++h) {
      const T* x = qk + t * q0 + h * q1;
      C* out = h < H ? q + (h * nt + t) * hd : kv + ((h - H) * S + slot) * hd;
      for (int64_t j = 0; j < hd; ++j) {
        const T a = static_cast<T>(static_cast<float>(x[j]) * static_cast<float>(c[j]));
        const T b = static_cast<T>(static_cast<float>(x[j < half ? j + half : j - half]) * static_cast<float>(s[j]));
        out[j] = static_cast<C>(static_cast<float>(static_cast<T>(static_cast<float>(a) + static_cast<float>(b))));
      }
    }
    for (int64_t h = 0; h < KVH; ++h) {
      const T* x = v + t * v0 + h * v1;
      C* out = kv + ((KVH + h) * S + slot) * hd;
      for (int64_t j = 0; j < hd; ++j) out[j] = static_cast<C>(static_cast<float>(x[j]));
    }
  }
}

template <typename T>
void run_as(const at::Tensor& qk, const at::Tensor& v, const at::Tensor& cs, const at::Tensor& sn, at::Tensor& kv,
            const at::Tensor& slots, at::Tensor& q, int64_t H, int64_t KVH) {
  const int64_t nt = qk.size(0), hd = qk.size(2), S = kv.size(1);
  const T* qp = qk.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const T* cp = cs.data_ptr<T>();
  const T* sp = sn.data_ptr<T>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv.scalar_type(), "rope_store", [&] {
    scalar_t* kp = kv.data_ptr<scalar_t>();
    scalar_t* op = q.data_ptr<scalar_t>();
    at::parallel_for(0, nt, 16, [&](int64_t t0, int64_t t1) {
      rows<T, scalar_t>(qp, qk.stride(0), qk.stride(1), vp, v.stride(0), v.stride(1), cp, sp, kp, S, sl, op, t0, t1,
                        nt, H, KVH, hd);
    });
  });
}

// qk [T, H + KVH, hd] (queries then keys, before rotation), v [T, KVH, hd], cos / sin [T, 1, hd] in qk's dtype,
// kv [2 KVH, S, hd] (written at `slots` [T]) -> the rotated queries [H, T, hd] in kv's dtype
at::Tensor rope_store(const at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor kv, const at::Tensor& slots) {
  TORCH_CHECK(qk.dim() == 3 && v.dim() == 3 && kv.dim() == 3 && kv.is_contiguous(), "rope_store: qk, v, kv 3-d, kv contiguous");
  const int64_t nt = qk.size(0), KVH = v.size(1), H = qk.size(1) - KVH, hd = qk.size(2);
  TORCH_CHECK(H > 0 && hd % 2 == 0 && v.size(0) == nt && v.size(2) == hd && kv.size(0) == 2 * KVH && kv.size(2) == hd,
              "rope_store: shapes qk [T, H + KVH, hd], v [T, KVH, hd], kv [2 KVH, S, hd]");
  TORCH_CHECK(qk.stride(2) == 1 && v.stride(2) == 1 && v.scalar_type() == qk.scalar_type(), "rope_store: rows contiguous, v in qk's dtype");
  TORCH_CHECK(cos.numel() == nt * hd && sin.numel() == nt * hd && cos.scalar_type() == qk.scalar_type() &&
              sin.scalar_type() == qk.scalar_type(), "rope_store: cos and sin [T, 1, hd] in qk's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == nt, "rope_store: slots [T] int64");
  at::Tensor cs = cos.contiguous(), sn = sin.contiguous(), sl = slots.contiguous();
  at::Tensor q = at::empty({H, nt, hd}, kv.options());
  switch (qk.scalar_type()) {
    case at::kFloat: run_as<float>(qk, v, cs, sn, kv, sl, q, H, KVH); break;
    case at::kBFloat16: run_as<at::BFloat16>(qk, v, cs, sn, kv, sl, q, H, KVH); break;
    case at::kHalf: run_as<at::Half>(qk, v, cs, sn, kv, sl, q, H, KVH); break;
    default: TORCH_CHECK(false, "rope_store: float32, bfloat16 or float16");
  }
  return q;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(verispec, m) {
  m.def("rope_store(Tensor qk, Tensor v, Tensor cos, Tensor sin, Tensor(a!) kv, Tensor slots) -> Tensor");
}

TORCH_LIBRARY_IMPL(verispec, CPU, m) {
  m.impl("rope_store", &rope_store);
}
