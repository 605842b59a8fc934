"""The layer step as one native call: core.layer_step's ATen operations issued from C++, not from Python.

Why. A decode step of a small model is a few hundred small operations; from Python each costs its
interpreter and binding overhead on top of the kernel (dev/native_step.py measures what this
saves). The C++ below issues THE SAME ATen operations in the same order with the same arguments as
core.layer_step (rms_norm -- norm.py's kernel where core.rms_norm calls it --, the projection kernels of
packed.py / quant.py, rope.py's rotation and cache write -- its kernel or the roll and index_copy_ --,
scaled_dot_product_attention, silu and the product -- glu.py's kernel where core.py calls it), so it
computes the same bits. One liberty: a layer's MLP residual is added by the next layer's input norm in
one call (norm.add_rms_norm, whose bits are the add's and then the norm's). core.layer_step stays the
reference and tests/test_native.py checks bit equality against it, in exact mode too (canonical.py's
attention, its operations likewise issued from C++). A pass is one native call for all layers (`layers`,
or `layers_canonical` in exact mode); a pass that captures hidden states (the drafters reading the
target's features) makes one such call per stretch of layers up to a captured one.

What it covers: the Llama-family step (no q/k norms, no sandwich norms, silu MLP) with projections that
are packed oneDNN weights, int4 / int8 weight-only ones (PyTorch's or qmm.py's) or plain ones
(F.linear), or packed.py's bf16 hybrid of AVX2 CPUs (F.linear at one row, the widened float32 copy at more);
anything else (Gemma 3, Qwen3) runs core.layer_step. The trained drafters' layers run the same way
(`eagle_run`: EagleDrafter._run; `dflash_blocks`: BlockDrafterModel.blocks at inference), their Python
code the reference (tests/test_heads.py, tests/test_dflash.py check the bits). Built on first use with
torch.utils.cpp_extension (a C++ compiler is needed; setup.sh builds it once); where the build fails
or VERISPEC_NATIVE=0 the Python step runs, and `status()` says why.
"""

from __future__ import annotations

import logging
import os
import threading

import torch
import torch.nn.functional as F

from verispec.fast import glu, norm, packed, quant, rope

log = logging.getLogger(__name__)

# projection kinds (the C++ dispatches on them): how packed.py / quant.py store and apply a weight
PACKED, INT4, INT8, PLAIN, QMM, HYBRID = 0, 1, 2, 3, 4, 5

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace {

constexpr int64_t PACKED = 0, INT4 = 1, INT8 = 2, PLAIN = 3, QMM = 4, HYBRID = 5;
constexpr int64_t MIN_ROWS = 4;   // packed.MIN_ROWS
constexpr int64_t HYBRID_ROWS = 2;  // packed.HYBRID_ROWS
constexpr int64_t GROUP = 32;     // quant.GROUP

at::Tensor raw_packed(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, w, b, std::string("none"), c10::List<std::optional<at::Scalar>>(),
                                 std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// packed._packed_linear, quant.linear, F.linear, packed._hybrid_linear
at::Tensor linear(const at::Tensor& x, int64_t kind, const at::Tensor& w0, const at::Tensor& w1,
                  const std::optional<at::Tensor>& b) {
  if (kind == HYBRID) {  // w0 the bf16 weight, w1 its widened float32 copy, packed (packed._widened)
    if (x.size(0) < HYBRID_ROWS) return at::linear(x, w0, b);
    const std::optional<at::Tensor> b32 = b.has_value() ? std::optional<at::Tensor>(b->to(at::kFloat)) : std::nullopt;
    return linear(x.to(at::kFloat), PACKED, w1, w1, b32).to(x.scalar_type());
  }
  if (kind == PACKED) {
    int64_t m = x.size(0);
    if (m >= MIN_ROWS) return raw_packed(x, w0, b);
    return raw_packed(at::constant_pad_nd(x, {0, 0, 0, MIN_ROWS - m}, 0), w0, b).slice(0, 0, m);
  }
  if (kind == PLAIN) return at::linear(x, w0, b);
  at::Tensor y;
  if (kind == QMM) {  // qmm.py's kernel, registered by its own extension (loaded before a weight of this kind exists)
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("verispec::qmm", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
    y = op.call(x, w0, w1);
  } else {
    y = kind == INT4 ? at::_weight_int4pack_mm_for_cpu(x, w0, GROUP, w1) : at::_weight_int8pack_mm(x, w0, w1);
  }
  return b.has_value() ? y + *b : y;
}

bool norm_kernel = false;  // norm.py's kernel runs (set from Python: use_norm_kernel)
bool rope_kernel = false;  // rope.py's kernel runs (set from Python: use_rope_kernel)
bool glu_kernel = false;   // glu.py's kernel runs (set from Python: use_glu_kernel)

void use_norm_kernel(bool on) { norm_kernel = on; }
void use_rope_kernel(bool on) { rope_kernel = on; }
void use_glu_kernel(bool on) { glu_kernel = on; }

bool float_type(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

// norm.rms_norm: its kernel (registered by its own extension) on the CPU where it runs, else the composite
at::Tensor norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const auto t = x.scalar_type();
  if (norm_kernel && x.is_cpu() && w.scalar_type() == t && float_type(t)) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("verispec::rms_norm", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
    return op.call(x, w, eps);
  }
  return w * at::rms_norm(x, {x.size(-1)}, std::nullopt, eps);
}

// glu.gated with SiLU: its kernel where glu.runs_on takes gu [T, 2I], else silu(gate) * up
at::Tensor silu_mul(const at::Tensor& gu) {
  const auto t = gu.scalar_type();
  if (glu_kernel && gu.is_cpu() && (t == at::kFloat || t == at::kBFloat16) && gu.stride(-1) == 1) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("verispec::silu_mul", "")
                         .typed<at::Tensor(const at::Tensor&)>();
    return op.call(gu);
  }
  auto parts = gu.chunk(2, -1);
  return at::silu(parts[0]) * parts[1];
}

// norm.add_rms_norm: (x + o, its norm), one kernel call where norm.runs_on takes x, else the add and norm()
std::tuple<at::Tensor, at::Tensor> add_norm(const at::Tensor& x, const at::Tensor& o, const at::Tensor& w, double eps) {
  const auto t = x.scalar_type();
  if (norm_kernel && x.is_cpu() && w.scalar_type() == t && o.scalar_type() == t && float_type(t) && o.sizes() == x.sizes()) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("verispec::add_rms_norm", "")
                         .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
    return op.call(x, o, w, eps);
  }
  at::Tensor y = x + o;
  return {y, norm(y, w, eps)};
}

// w: ln_attn, ln_mlp, then (w0, w1) of wqkv, wo, wgu, wdown; kinds: their 4 kinds; biases: bqkv, bo
struct Layer {
  std::vector<at::Tensor> w;
  std::vector<int64_t> kinds;
  std::optional<at::Tensor> bqkv, bo;
};

// The hidden states between layers: x, or x + mlp where the last layer's MLP residual is still to be added
// (the next layer adds it in the same call as its input norm: norm.add_rms_norm, the same bits as the add
// and then the norm)
struct Stream {
  at::Tensor x;
  std::optional<at::Tensor> mlp;
  at::Tensor sum() const { return mlp.has_value() ? x + *mlp : x; }
};

// s [T, hidden] -> queries [H, T, hd] in kv's dtype; keys and values written to kv at `slots`; s.x is then
// the layer's input with any pending residual added
at::Tensor attn_in(Stream& s, const std::vector<at::Tensor>& w, const std::vector<int64_t>& kinds,
                   const std::optional<at::Tensor>& bqkv, at::Tensor kv, const at::Tensor& slots,
                   const at::Tensor& cos, const at::Tensor& sin, int64_t H, int64_t KVH, int64_t hd, double eps) {
  at::Tensor h;
  if (s.mlp.has_value()) {
    std::tie(s.x, h) = add_norm(s.x, *s.mlp, w[0], eps);
    s.mlp.reset();
  } else {
    h = norm(s.x, w[0], eps);
  }
  const at::Tensor& x = s.x;
  int64_t T = x.size(0);
  at::Tensor qkv = linear(h, kinds[0], w[2], w[3], bqkv).view({T, H + 2 * KVH, hd});
  at::Tensor qk = qkv.slice(1, 0, H + KVH);
  // rope.rotate_store: its kernel where rope.runs_on takes these inputs, else the same operations
  if (rope_kernel && x.is_cpu() && float_type(qk.scalar_type()) && float_type(kv.scalar_type()) &&
      cos.scalar_type() == qk.scalar_type()) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("verispec::rope_store", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           at::Tensor, const at::Tensor&)>();
    return op.call(qk, qkv.slice(1, H + KVH), cos, sin, kv, slots);
  }
  qk = qk * cos + at::roll(qk, {hd / 2}, {-1}) * sin;
  kv.index_copy_(1, slots, at::cat({qk.slice(1, H), qkv.slice(1, H + KVH)}, 1).transpose(0, 1).to(kv.scalar_type()));
  return qk.slice(1, 0, H).transpose(0, 1).to(kv.scalar_type());
}

// attention output o [H, T, hd] -> s holds the layer's output [T, hidden] (its MLP residual pending)
void attn_out(Stream& s, const at::Tensor& o_heads, const std::vector<at::Tensor>& w,
              const std::vector<int64_t>& kinds, const std::optional<at::Tensor>& bo, double eps) {
  int64_t T = s.x.size(0);
  at::Tensor o = o_heads.transpose(0, 1).to(s.x.scalar_type()).reshape({T, -1});
  o = linear(o, kinds[1], w[4], w[5], bo);
  auto [y, h] = add_norm(s.x, o, w[1], eps);
  s.x = y;
  s.mlp = linear(silu_mul(linear(h, kinds[2], w[6], w[7], std::nullopt)), kinds[3], w[8], w[9], std::nullopt);
}

// the whole step with the fused attention kernel (core.layer_step with canon=None)
void step(Stream& s, const std::vector<at::Tensor>& w, const std::vector<int64_t>& kinds,
                const std::optional<at::Tensor>& bqkv, const std::optional<at::Tensor>& bo, at::Tensor kv,
                const at::Tensor& slots, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& mask,
                int64_t H, int64_t KVH, int64_t hd, double eps, double scale) {
  at::Tensor qh = attn_in(s, w, kinds, bqkv, kv, slots, cos, sin, H, KVH, hd, eps);
  int64_t L = mask.size(-1);
  at::Tensor o = at::scaled_dot_product_attention(
      qh.unsqueeze(0), kv.slice(0, 0, KVH).slice(1, 0, L).unsqueeze(0), kv.slice(0, KVH).slice(1, 0, L).unsqueeze(0),
      mask.unsqueeze(0).unsqueeze(0), 0.0, false, scale, H != KVH).select(0, 0);
  attn_out(s, o, w, kinds, bo, eps);
}

// every layer of a pass in one call (the fused attention kernel): layers[i] uses masks[mask_of[i]]
at::Tensor layers(at::Tensor x, const std::vector<std::vector<at::Tensor>>& ws,
                  const std::vector<std::vector<int64_t>>& kinds, const std::vector<std::optional<at::Tensor>>& bqkv,
                  const std::vector<std::optional<at::Tensor>>& bo, const std::vector<at::Tensor>& kv,
                  const at::Tensor& slots, const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                  const std::vector<at::Tensor>& masks, const std::vector<int64_t>& table_of,
                  const std::vector<int64_t>& mask_of, int64_t H, int64_t KVH, int64_t hd, double eps, double scale) {
  Stream s{x};
  for (size_t i = 0; i < ws.size(); ++i)
    step(s, ws[i], kinds[i], bqkv[i], bo[i], kv[i], slots, cos[table_of[i]], sin[table_of[i]], masks[mask_of[i]], H,
         KVH, hd, eps, scale);
  return s.sum();
}

// canonical.attention's operations: q [H, T, D], caches [KVH, S, D], bias [G*T, L]; kernel: attend.py's
// kernel (order the plan's [T, L] order, or none: then `flat` is the empty tensor the kernel reads as
// "columns are slots"), else the PyTorch operations with the plan's tensors as
// Canon.expanded(G) and Canon.flat_slots give them
struct Canon {
  bool kernel;
  std::optional<at::Tensor> order, tail_past;
  at::Tensor tail_cols, flat;
  std::vector<int64_t> cuts;
  std::vector<at::Tensor> rows;
};

constexpr int64_t TAIL = 128;  // canonical.TAIL

at::Tensor canon_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& bias, double scale, const Canon& c) {
  if (c.kernel) {  // attend.py's kernel, registered by its own extension (loaded before such a pass runs)
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("verispec::attend", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           const at::Tensor&, double)>();
    return op.call(q, k_cache, v_cache, bias, c.order.has_value() ? *c.order : c.flat, scale);
  }
  int64_t H = q.size(0), T = q.size(1), D = q.size(2), L = bias.size(-1), kvh = k_cache.size(0), g = H / kvh;
  at::Tensor qg = (q * scale).reshape({kvh, g * T, D});
  at::Tensor s = at::bmm(qg, k_cache.slice(1, 0, L).transpose(1, 2));
  if (c.order.has_value()) s = s.gather(-1, c.order->expand({kvh, g * T, L}));
  at::Tensor p = at::softmax(s.add_(bias), -1);
  std::optional<at::Tensor> head;
  for (size_t i = 0; i < c.cuts.size(); ++i) {
    int64_t b = c.cuts[i];
    if (b == 0) continue;
    at::Tensor part = at::bmm(p.slice(2, 0, b).contiguous(), v_cache.slice(1, 0, b));
    if (!head.has_value())
      head = c.cuts.size() == 1 ? part : at::where(c.rows[i], part, 0.0);
    else
      head = at::where(c.rows[i], part, *head);
  }
  at::Tensor pt = p.gather(-1, c.tail_cols.expand({kvh, g * T, TAIL}));
  if (c.tail_past.has_value()) pt.masked_fill_(*c.tail_past, 0.0);
  pt = pt.reshape({kvh, g, T, TAIL}).transpose(1, 2);
  at::Tensor vt = v_cache.view({-1, D}).index_select(0, c.flat).reshape({kvh, T, TAIL, D});
  at::Tensor tail = at::matmul(pt, vt).transpose(1, 2).reshape({kvh, g * T, D});
  at::Tensor out = head.has_value() ? *head + tail : tail;
  return out.reshape({H, T, D});
}

// every layer of an exact-mode pass in one call: canonical attention between the halves
at::Tensor layers_canonical(at::Tensor x, const std::vector<std::vector<at::Tensor>>& ws,
                            const std::vector<std::vector<int64_t>>& kinds,
                            const std::vector<std::optional<at::Tensor>>& bqkv,
                            const std::vector<std::optional<at::Tensor>>& bo, const std::vector<at::Tensor>& kv,
                            const at::Tensor& slots, const std::vector<at::Tensor>& cos,
                            const std::vector<at::Tensor>& sin, const std::vector<at::Tensor>& biases,
                            const std::vector<int64_t>& table_of, const std::vector<int64_t>& mask_of,
                            const std::optional<at::Tensor>& order, const at::Tensor& tail_cols,
                            const std::vector<int64_t>& cuts, const std::vector<at::Tensor>& rows,
                            const std::optional<at::Tensor>& tail_past, const at::Tensor& flat, bool kernel,
                            int64_t H, int64_t KVH, int64_t hd, double eps, double scale) {
  Canon c{kernel, order, tail_past, tail_cols, flat, cuts, rows};
  Stream s{x};
  for (size_t i = 0; i < ws.size(); ++i) {
    at::Tensor qh = attn_in(s, ws[i], kinds[i], bqkv[i], kv[i], slots, cos[table_of[i]], sin[table_of[i]],
                            H, KVH, hd, eps);
    at::Tensor o = canon_attention(qh, kv[i].slice(0, 0, KVH), kv[i].slice(0, KVH), biases[mask_of[i]], scale, c);
    attn_out(s, o, ws[i], kinds[i], bo[i], eps);
  }
  return s.sum();
}

// ---- drafters/eagle.py: EagleDrafter._run (the head's layers over m new entries) as one call
// Its operations as EagleHead.inputs / qkv / finish and head_parts issue them: RMSNorm (the kernel where it runs,
// else its own composite), PackedLinears.lin (the input cast to the copy's dtype where it has one, the output
// back to the activations' dtype), head_parts.rotary / rotate, the cache writes, scaled_dot_product_attention.

// RMSNorm.forward in inference: the kernel where norm.runs_on takes x, else the module's own composite
at::Tensor head_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const auto t = x.scalar_type();
  if (norm_kernel && x.is_cpu() && w.scalar_type() == t && float_type(t)) return norm(x, w, eps);
  at::Tensor h = x.to(at::kFloat);
  return (h * at::rsqrt(h.pow(2).mean({-1}, true) + eps)).to(t) * w;
}

// The head's linears: per linear its kind, two weight tensors and the dtype its input is cast to (None: as is);
// a group (q, k, v; gate, up) is one stacked linear whose output is split, or one linear per member
struct HeadLinears {
  std::vector<int64_t> kinds;
  std::vector<at::Tensor> w;
  std::vector<std::optional<at::Tensor>> in;
  at::Tensor apply(const at::Tensor& x, int64_t i) const {  // x [..., K] -> [..., N]
    at::Tensor flat = x.reshape({-1, x.size(-1)});
    if (in[i].has_value()) flat = flat.to(in[i]->scalar_type());
    at::Tensor out = linear(flat, kinds[i], w[2 * i], w[2 * i + 1], std::nullopt).to(x.scalar_type());
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
    shape.push_back(out.size(-1));
    return out.reshape(shape);
  }
  // linears first .. first + count - 1 applied to x: one stacked linear split by `sizes`, or each
  std::vector<at::Tensor> group(const at::Tensor& x, int64_t first, int64_t count, at::IntArrayRef sizes) const {
    if (count == 1) return apply(x, first).split_with_sizes(sizes, -1);
    std::vector<at::Tensor> out;
    for (int64_t i = 0; i < count; ++i) out.push_back(apply(x, first + i));
    return out;
  }
};

// ids [m] long, g [m, H] features (projected), pos [m], slots [m] long, mask [m, L] bool; K, V [layers, nkv, S, hd]
// (written at slots); embed the target's table; norms: norm_e, norm_h, then per layer ln1 (layer 0 of the eagle3
// layout: none, the verispec layout's ln1), ln2; lin_at: per layer the index of its first linear (verispec layout:
// linear 0 is inp); qkv_count, gu_count: per layer the linears of its q/k/v and gate/up groups (1 or 3, 1 or 2)
// -> the last layer's output [m, H]
at::Tensor eagle_run(const at::Tensor& ids, const at::Tensor& g, const at::Tensor& pos, const at::Tensor& slots,
                     const at::Tensor& mask, at::Tensor K, at::Tensor V, const at::Tensor& embed,
                     const std::vector<at::Tensor>& norms, const std::vector<int64_t>& kinds,
                     const std::vector<at::Tensor>& w, const std::vector<std::optional<at::Tensor>>& in,
                     const std::vector<int64_t>& lin_at, const std::vector<int64_t>& qkv_count,
                     const std::vector<int64_t>& gu_count, const at::Tensor& inv_freq, bool eagle3,
                     bool norm_before_residual, int64_t nh, int64_t nkv, int64_t hd, int64_t inter, double eps) {
  const HeadLinears L{kinds, w, in};
  const int64_t m = ids.size(0), H = g.size(-1), layers = static_cast<int64_t>(lin_at.size());
  at::Tensor e = head_norm(at::embedding(embed, ids).to(g.scalar_type()), norms[0], eps);
  at::Tensor gn = head_norm(g, norms[1], eps);
  at::Tensor x = eagle3 ? at::cat({e, gn, norm_before_residual ? gn : g}, -1) : L.apply(at::cat({e, gn}, -1), 0);
  const int64_t Lk = mask.size(1);
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t a = lin_at[l];
    const at::Tensor& ln1 = norms[2 + 2 * l];
    at::Tensor h = l == 0 && eagle3 ? x.slice(-1, 0, x.size(-1) - H) : head_norm(x, ln1, eps);
    auto qkv = L.group(h, a, qkv_count[l], {nh * hd, nkv * hd, nkv * hd});
    at::Tensor q = qkv[0].reshape({m, nh, hd}).transpose(-3, -2);
    at::Tensor k = qkv[1].reshape({m, nkv, hd}).transpose(-3, -2);
    at::Tensor v = qkv[2].reshape({m, nkv, hd}).transpose(-3, -2);
    at::Tensor freqs = pos.to(at::kFloat).unsqueeze(-1) * inv_freq;
    at::Tensor c = freqs.cos(), sn = freqs.sin();
    at::Tensor cos = at::cat({c, c}, -1).unsqueeze(-3).to(q.scalar_type());
    at::Tensor sin = at::cat({-sn, sn}, -1).unsqueeze(-3).to(q.scalar_type());
    q = q * cos + q.roll({hd / 2}, {-1}) * sin;
    k = k * cos + k.roll({hd / 2}, {-1}) * sin;
    at::Tensor Kl = K.select(0, l), Vl = V.select(0, l);
    Kl.index_put_({at::indexing::Slice(), slots}, k);
    Vl.index_put_({at::indexing::Slice(), slots}, v);
    at::Tensor attn = at::scaled_dot_product_attention(
        q.unsqueeze(0), Kl.unsqueeze(0).slice(2, 0, Lk), Vl.unsqueeze(0).slice(2, 0, Lk),
        mask.unsqueeze(0).unsqueeze(0), 0.0, false, std::nullopt, nh != nkv).select(0, 0);
    at::Tensor r = l == 0 && eagle3 ? x.slice(-1, x.size(-1) - H) : x;
    const int64_t o_at = a + qkv_count[l];
    x = r + L.apply(attn.transpose(-3, -2).reshape({m, -1}), o_at);
    auto gu = L.group(head_norm(x, norms[3 + 2 * l], eps), o_at + 1, gu_count[l], {inter, inter});
    x = x + L.apply(at::silu(gu[0]) * gu[1], o_at + 1 + gu_count[l]);
  }
  return x;
}

// ---- drafters/dflash.py: BlockDrafterModel.blocks at inference (no mask) as one call
// x [b, R, H] block rows at positions pos [b, R]; ctx_k, ctx_v per layer [b, nkv, S, hd]; norms: per layer ln1, ln2,
// then the final norm; linears: per layer its qkv group, o, its gate/up group, down (lin_at: the first of each
// layer), then lm_head -> logits [b, R, Vd] in float32
at::Tensor dflash_blocks(at::Tensor x, const at::Tensor& pos, const std::vector<at::Tensor>& ctx_k,
                         const std::vector<at::Tensor>& ctx_v, const std::vector<at::Tensor>& norms,
                         const std::vector<int64_t>& kinds, const std::vector<at::Tensor>& w,
                         const std::vector<std::optional<at::Tensor>>& in, const std::vector<int64_t>& lin_at,
                         const std::vector<int64_t>& qkv_count, const std::vector<int64_t>& gu_count,
                         const at::Tensor& inv_freq, int64_t nh, int64_t nkv, int64_t hd, int64_t inter, double eps) {
  const HeadLinears L{kinds, w, in};
  const int64_t layers = static_cast<int64_t>(lin_at.size());
  std::optional<at::Tensor> cos, sin;  // the same positions in every layer
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t a = lin_at[l];
    at::Tensor h = head_norm(x, norms[2 * l], eps);
    auto qkv = L.group(h, a, qkv_count[l], {nh * hd, nkv * hd, nkv * hd});
    auto heads = [&](const at::Tensor& t, int64_t n) {
      std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end() - 1);
      shape.push_back(n);
      shape.push_back(hd);
      return t.reshape(shape).transpose(-3, -2);
    };
    at::Tensor q = heads(qkv[0], nh), k = heads(qkv[1], nkv), v = heads(qkv[2], nkv);
    if (!cos.has_value()) {
      at::Tensor freqs = pos.to(at::kFloat).unsqueeze(-1) * inv_freq;
      at::Tensor c = freqs.cos(), sn = freqs.sin();
      cos = at::cat({c, c}, -1).unsqueeze(-3).to(q.scalar_type());
      sin = at::cat({-sn, sn}, -1).unsqueeze(-3).to(q.scalar_type());
    }
    q = q * *cos + q.roll({hd / 2}, {-1}) * *sin;
    k = k * *cos + k.roll({hd / 2}, {-1}) * *sin;
    at::Tensor K = at::cat({ctx_k[l].to(k.scalar_type()), k}, -2);
    at::Tensor V = at::cat({ctx_v[l].to(v.scalar_type()), v}, -2);
    at::Tensor attn = at::scaled_dot_product_attention(q, K, V, std::nullopt, 0.0, false, std::nullopt, nh != nkv);
    const int64_t o_at = a + qkv_count[l];
    x = x + L.apply(attn.transpose(-3, -2).flatten(-2), o_at);
    auto gu = L.group(head_norm(x, norms[2 * l + 1], eps), o_at + 1, gu_count[l], {inter, inter});
    x = x + L.apply(at::silu(gu[0]) * gu[1], o_at + 1 + gu_count[l]);
  }
  return L.apply(head_norm(x, norms[2 * layers], eps), static_cast<int64_t>(kinds.size()) - 1).to(at::kFloat);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("layers", &layers);
  m.def("layers_canonical", &layers_canonical);
  m.def("eagle_run", &eagle_run);
  m.def("dflash_blocks", &dflash_blocks);
  m.def("use_norm_kernel", &use_norm_kernel);
  m.def("use_rope_kernel", &use_rope_kernel);
  m.def("use_glu_kernel", &use_glu_kernel);
}
"""

_LOCK = threading.Lock()
_STATE: dict = {}


def module():
    """The built extension, or None (the reason in status())."""
    with _LOCK:
        if "module" not in _STATE:
            _STATE["module"], _STATE["why"] = _build()
        return _STATE["module"]


def status() -> str:
    """'native' where the extension is in use, else why the Python step runs."""
    return "native" if module() is not None else _STATE["why"]


def _build():
    if os.environ.get("VERISPEC_NATIVE", "1") == "0":
        return None, "VERISPEC_NATIVE=0"
    try:
        from torch.utils.cpp_extension import load_inline

        mod = load_inline("verispec_native_step", cpp_sources=_SOURCE, extra_cflags=["-O2"], verbose=False)
        mod.use_norm_kernel(norm.available() is None)  # as core.rms_norm decides (norm.runs_on)
        mod.use_rope_kernel(rope.available() is None)  # as rope.rotate_store decides (rope.runs_on)
        mod.use_glu_kernel(glu.available() is None)  # as glu.gated decides (glu.runs_on)
        return mod, "native"
    except Exception as exc:  # no compiler, no headers, a failed build: the Python step runs
        why = f"native step unavailable ({type(exc).__name__}: {str(exc).strip().splitlines()[-1][:120] if str(exc).strip() else ''})"
        log.warning("%s; running the Python layer step", why)
        return None, why


# the functions whose kernels the C++ issues, as imported (a linear replaced later, e.g. by a test planting
# another rounding, is not one of them and runs the Python step)
_PACKED_LINEAR, _QUANT_LINEAR, _PLAIN_LINEAR, _HYBRID_LINEAR = packed._packed_linear, quant.linear, F.linear, packed._hybrid_linear


def kind_of(linear, w) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """(kind, w0, w1) of a projection weight as `linear` applies it, or None where the C++ has no such kind."""
    empty = torch.empty(0)
    if linear is _PACKED_LINEAR:
        return PACKED, w, empty
    if linear is _QUANT_LINEAR:
        if isinstance(w, quant.qmm.QWeight):
            return QMM, w.w, w.sc
        return (INT4, w.packed, w.sz) if isinstance(w, quant.Int4) else (INT8, w.q, w.scale)
    if linear is _PLAIN_LINEAR:
        return PLAIN, w, empty
    if linear is _HYBRID_LINEAR:
        return HYBRID, w[0], w[1]
    return None


def layer_args(arch, linear, lw: dict) -> tuple | None:
    """One layer's weights as the C++ takes them: (weights, kinds, bqkv, bo), or None where the step is
    not the Llama-family one or a projection kind is unknown (the Python step runs then)."""
    if arch.qk_norm or arch.sandwich or arch.gemma_norm or not glu.is_silu(arch.act):
        return None
    kinds, w = [], [lw["ln_attn"], lw["ln_mlp"]]
    for key in ("wqkv", "wo", "wgu", "wdown"):
        k = kind_of(linear, lw[key])
        if k is None:
            return None
        kinds.append(k[0])
        w += [k[1], k[2]]
    return w, kinds, lw.get("bqkv"), lw.get("bo")


def head_linears(module, pre: list[str], layers: list[str], post: list[str]) -> tuple | None:
    """A drafter head's linears as eagle_run / dflash_blocks take them: the linears `pre`, then per decoder
    layer (its name prefix in `layers`) its q/k/v, o, gate/up and down, then `post`, each as PackedLinears.lin /
    lins apply it (a group: one stacked copy, or each member) -> (kinds, weights, input dtypes, index of each
    layer's first linear, linears in each layer's q/k/v group, in its gate/up group), or None where a linear
    has a bias or a kind the C++ does not know (the Python operations run then)."""
    groups, firsts = list(pre), []
    for p in layers:
        firsts.append(len(groups))
        groups += [(p + "q", p + "k", p + "v"), p + "o", (p + "gate", p + "up"), p + "down"]
    groups += post
    kinds, ws, ins, counts = [], [], [], []
    packed = module._packed
    for entry in groups:
        if isinstance(entry, tuple) and (packed is None or entry not in packed):
            members = list(entry)
        else:
            members = [entry]
        for name in members:
            if packed is None:
                lin = module.get_submodule(name)
                if lin.bias is not None:
                    return None
                got, dtype = kind_of(_PLAIN_LINEAR, lin.weight), None
            else:
                w, linear, dtype, bias = packed[name]
                if bias is not None:
                    return None
                got = kind_of(linear, w)
            if got is None:
                return None
            kinds.append(got[0])
            ws += [got[1], got[2]]
            ins.append(None if dtype is None else torch.empty(0, dtype=dtype))
        counts.append(len(members))
    at = [sum(counts[:i]) for i in firsts]
    return kinds, ws, ins, at, [counts[i] for i in firsts], [counts[i + 2] for i in firsts]
