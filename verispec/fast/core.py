"""The pieces every fast family module shares: RMS norms, rotary embedding, and ONE decoder-layer step
over a preallocated KV cache.

The layer step is a pure function of tensors (weights come in as arguments, not module attributes), so
that `torch.compile` makes one graph per token bucket and reuses it for every layer of the model:
compile cost is one layer's, not the whole model's. Numerics follow transformers' own modules (norms in
float32, rotary tables computed in float32 and cast to the model dtype) so logits agree within dtype
tolerance; the static structure (heads, norm flavour, sandwich norms, q/k norms) is a frozen `Arch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from verispec.fast import canonical, glu, norm, rope


@dataclass(frozen=True)
class Arch:
    """Static shape and flavour of a decoder layer (the same for every layer of a model)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float
    scale: float                     # softmax scale (head_dim**-0.5, or Gemma's query_pre_attn_scalar**-0.5)
    act: Callable                    # the MLP activation (forward of transformers' ACT2FN entry: no module call)
    gemma_norm: bool = False         # Gemma RMSNorm: x * (1 + w), scaled in float32 before the cast
    sandwich: bool = False           # Gemma: extra norms after attention and after the MLP
    qk_norm: bool = False            # Qwen3 / Gemma 3: RMSNorm over head_dim on q and k before RoPE


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    # transformers' roundings: the normalised row in float32 cast once to the dtype, then the weight's product;
    # norm.py's kernel on the CPU (one call instead of torch.rms_norm's half dozen), else torch.rms_norm
    if gemma:  # transformers' Gemma3RMSNorm: (x * (1 + w)) in float32, then cast
        return (torch.rms_norm(x.float(), x.shape[-1:], None, eps) * (1.0 + w.float())).to(x.dtype)
    return norm.rms_norm(x, w, eps)  # LlamaRMSNorm (cast first, then scale): one kernel on the CPU


def add_rms_norm(x: torch.Tensor, o: torch.Tensor, w: torch.Tensor, eps: float, gemma: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + o, rms_norm(x + o)): a residual sum and the norm after it, one kernel call on the CPU (norm.py)."""
    if gemma:
        y = x + o
        return y, rms_norm(y, w, eps, gemma)
    return norm.add_rms_norm(x, o, w, eps)


def rope_tables(pos: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float, dtype: torch.dtype):
    """pos [T] -> cos, sin [T, 1, head_dim] in `dtype` (computed in float32 like transformers), the first
    half of sin negated: rotate-half then becomes a roll (rope.rotate), the same products with the sign moved
    from x to sin, so the same bits."""
    freqs = pos.float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * attention_scaling).to(dtype)
    sin = (emb.sin() * attention_scaling).to(dtype)
    half = sin.shape[-1] // 2
    sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos[:, None, :], sin[:, None, :]


def layer_step(x: torch.Tensor, w: dict, kv: torch.Tensor, slots: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, a: Arch,
               linear: Callable = F.linear, canon=None) -> torch.Tensor:
    """One decoder layer for T tokens.

    x:       [T, hidden]              hidden states of the tokens in this pass
    w:       dict of this layer's weights (see the family modules for the keys)
    kv:      [2 * n_kv_heads, S, head_dim] this layer's preallocated keys (rows :n_kv_heads) and values
             (the rest); written in place
    slots:   LongTensor [T]           the cache slot each token's key/value goes to
    cos/sin: [T, 1, head_dim]         rotary tables for the tokens' position ids (rope_tables)
    mask:    [T, L] additive float    0 where token t may attend to cache slot s, -inf elsewhere (L <= S)
    linear:  how the projection weights in `w` are applied (F.linear, or the packed op of packed.py)
    canon:   a canonical.Canon plan (exact mode): attention independent of the key layout; `mask` is
             then canonical.bias(...) of the mask in canonical (position) order
    """
    qk, qkv = _attention_in(x, w, a, linear)
    return _attention_out(x, _attend(qk, qkv, cos, sin, kv, slots, mask, a, canon, x.dtype), w, a, linear)


def layer_step_parts(x: torch.Tensor, w: dict, parts: list[tuple], cos: torch.Tensor, sin: torch.Tensor, a: Arch,
                     linear: Callable = F.linear) -> torch.Tensor:
    """layer_step for the rows of several sequences at once (a batch): the projections and the MLP run
    over all rows in one GEMM each, attention per sequence over its own cache. parts: (rows, kv, slots,
    mask, canon) per sequence, rows the slice of x it owns, the rest as in layer_step. Each row gets the
    same operations as in layer_step, so where the GEMMs give a row the same bits at any row count
    (row_invariance.py) a sequence's result does not depend on its company."""
    qk, qkv = _attention_in(x, w, a, linear)
    o = torch.cat([_attend(qk[rows], qkv[rows], cos[rows], sin[rows], kv, slots, mask, a, canon, x.dtype)
                   for rows, kv, slots, mask, canon in parts])
    return _attention_out(x, o, w, a, linear)


def _attention_in(x, w, a: Arch, linear):
    """The attention input norm, the q/k/v projection (one GEMM) and the q/k norms -> (q and k before rotary
    embedding [T, H + KVH, hd], the projection [T, H + 2 KVH, hd])."""
    T = x.shape[0]
    H, KVH, hd = a.n_heads, a.n_kv_heads, a.head_dim
    h = rms_norm(x, w["ln_attn"], a.eps, a.gemma_norm)
    qkv = linear(h, w["wqkv"], w.get("bqkv")).view(T, H + 2 * KVH, hd)
    if a.qk_norm:
        qk = torch.cat((rms_norm(qkv[:, :H], w["q_norm"], a.eps, a.gemma_norm),
                        rms_norm(qkv[:, H:H + KVH], w["k_norm"], a.eps, a.gemma_norm)), dim=1)
    else:
        qk = qkv[:, :H + KVH]
    return qk, qkv


def _attend(qk, qkv, cos, sin, kv, slots, mask, a: Arch, canon, dtype) -> torch.Tensor:
    """Rotate one sequence's queries and keys, write its keys and values into its cache and attend ->
    [T, H * hd] in `dtype`."""
    T = qk.shape[0]
    H, KVH, hd = a.n_heads, a.n_kv_heads, a.head_dim
    # queries and keys rotated in one go, keys and values into their slots (the cache may hold a wider dtype
    # than the model: float32 for bfloat16 on CPU, see FastDecoder): one kernel call (rope.py), as per-layer
    # op count is most of the non-GEMM time of a CPU decode step
    qh = rope.rotate_store(qk, qkv[:, H + KVH:], cos, sin, kv, slots)  # [H, T, hd]
    L = mask.shape[-1]
    if canon is not None:
        o = canonical.attention(qh, kv[:KVH], kv[KVH:], mask, a.scale, canon)
    else:
        o = F.scaled_dot_product_attention(qh[None], kv[None, :KVH, :L], kv[None, KVH:, :L],
                                           attn_mask=mask[None, None], scale=a.scale,
                                           enable_gqa=H != KVH)[0]
    return o.transpose(0, 1).to(dtype).reshape(T, H * hd)  # a view at T = 1


def _attention_out(x, o, w, a: Arch, linear) -> torch.Tensor:
    """The output projection, the residual, the MLP and its residual."""
    o = linear(o, w["wo"], w.get("bo"))
    if a.sandwich:
        o = rms_norm(o, w["ln_post_attn"], a.eps, a.gemma_norm)
    x, h = add_rms_norm(x, o, w["ln_mlp"], a.eps, a.gemma_norm)
    h = linear(glu.gated(linear(h, w["wgu"]), a.act), w["wdown"])  # act(gate) * up: one kernel for SiLU
    if a.sandwich:
        h = rms_norm(h, w["ln_post_mlp"], a.eps, a.gemma_norm)
    return x + h


def fused(*linears: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of linears that read the same input: one GEMM instead of
    several. A copy of those weights; the transformers model keeps its own."""
    w = torch.cat([m.weight.detach() for m in linears], dim=0).contiguous()
    if all(m.bias is None for m in linears):
        return w, None
    b = torch.cat([m.bias.detach() if m.bias is not None else torch.zeros(m.out_features, dtype=w.dtype, device=w.device)
                   for m in linears])
    return w, b


def projection_names(i: int) -> dict[str, tuple[str, ...]]:
    """The transformers parameter names each fused projection of layer i is made of (Llama and Gemma 3
    name them alike), so that a weight source (a GGUF's own blocks) can be asked for them."""
    at, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
    return {"wqkv": tuple(f"{at}.{p}_proj.weight" for p in "qkv"), "wo": (f"{at}.o_proj.weight",),
            "wgu": (f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"), "wdown": (f"{mlp}.down_proj.weight",)}


def rope_of(rotary: torch.nn.Module, prefix: str = "") -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling from a loaded transformers rotary module (so every rope type its
    init functions know, llama3 / linear / yarn scaling included, comes for free)."""
    inv = getattr(rotary, f"{prefix}inv_freq").detach().float().clone()
    scaling = float(getattr(rotary, f"{prefix}attention_scaling", getattr(rotary, "attention_scaling", 1.0)))
    return inv, scaling
