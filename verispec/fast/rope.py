"""Rotary embedding and the KV-cache write as one small CPU kernel.

Why. In a layer step, rotating queries and keys and writing keys and values into the cache was a dozen
ATen operations (two products, the roll, the sum, the concatenation, transposes, casts, index_copy_),
each a few microseconds of dispatch and allocation against well under a microsecond of arithmetic at
decode shapes; 30 layers make that a tenth of a one-position forward on a quantized model. Here one call
does it, with the same arithmetic and roundings per element as those operations:

    r = cast(cast(x * cos) + cast(roll(x, hd / 2) * sin))     (x: a query or key head, in the model dtype;
                                                                 sin's first half negated: core.rope_tables)
    queries -> [H, T, hd] in the cache dtype (returned); keys r and values v -> cache[:, slot]

so its bits equal the operations' (tests/test_rope.py), and a row's result depends only on the row.
The Python step (core.py) and the native step (native.py) both call it where it runs. Built for the CPU's
x86-64 level without floating-point contraction (a contracted x * cos + y * sin would round once, not
three times); where it does not build, or VERISPEC_ROPE=0, the operations run.
"""

from __future__ import annotations

import torch

from verispec.fast import ops

_SOURCE = r"""
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
"""

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _load() -> str | None:
    ops.load_for_cpu("rope", _SOURCE, contract=False)
    return None


OPERATOR = ops.Operator("rope_store", "VERISPEC_ROPE", _load, "rotary embedding and the cache write run as ATen operations")


def available() -> str | None:
    """None where the kernel runs here, else why not (logged once)."""
    return OPERATOR.available()


def runs_on(qk: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether the kernel takes these inputs (CPU, float dtypes, tables in qk's dtype, kernel built; not inside
    torch.compile, which fuses the operations itself). native.py's C++ decides the same way."""
    if torch.compiler.is_compiling():
        return False
    return (qk.device.type == "cpu" and qk.dtype in DTYPES and kv.dtype in DTYPES and cos.dtype == qk.dtype
            and available() is None)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin as ATen operations (sin from core.rope_tables: first half negated)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def rotate_store(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                 slots: torch.Tensor) -> torch.Tensor:
    """Rotate queries and keys qk [T, H + KVH, hd], write the keys and v [T, KVH, hd] into kv [2 KVH, S, hd]
    at `slots` -> the rotated queries [H, T, hd] in kv's dtype: the kernel where it runs, else the operations."""
    if runs_on(qk, kv, cos) and qk.stride(-1) == 1 and v.stride(-1) == 1:
        return torch.ops.verispec.rope_store(qk, v, cos, sin, kv, slots)
    H = qk.shape[1] - v.shape[1]
    r = rotate(qk, cos, sin)
    # the position is the pointer: keys and values land in their slots in one copy, nothing is concatenated
    # onto the cache or reallocated
    kv.index_copy_(1, slots, torch.cat((r[:, H:], v), dim=1).transpose(0, 1).to(kv.dtype))
    return r[:, :H].transpose(0, 1).to(kv.dtype)
