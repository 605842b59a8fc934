"""The Llama family as one configurable fast module: Llama 2/3, SmolLM2, Mistral, Qwen2 (q/k/v biases),
Qwen3 (q/k RMSNorm over the head dim), with per-layer sliding windows where the config has them.

Reads the weights of an already loaded transformers model; nothing of transformers' modeling code runs.
"""

from __future__ import annotations

import torch
from transformers.activations import ACT2FN

from verispec.fast.core import Arch, fused, projection_names, rope_of
from verispec.fast.decoder import FastDecoder

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# rope types whose inverse frequencies are fixed at load time (dynamic ones change with the length)
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def unsupported_reason(model) -> str | None:
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in MODEL_TYPES:
        return f"model type {getattr(cfg, 'model_type', None)!r} is not in the Llama family"
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in STATIC_ROPE:
        return f"rope type {rope!r} is not supported by the fast path"
    if getattr(cfg, "pretraining_tp", 1) not in (1, None):
        return "pretraining_tp > 1 is not supported"
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        return "unexpected module layout"
    return None


def _windows(cfg) -> list[int | None]:
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else None for t in types[:n]]
    if cfg.model_type == "mistral":  # Mistral applies its window on every layer when set
        return [window] * n
    return [None] * n


class FastLlama(FastDecoder):
    family = "llama"

    def __init__(self, model, weights: str = "bf16", weight_source=None, wide: bool = True):
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(reason)
        cfg, base = model.config, model.model
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        first = base.layers[0].self_attn
        arch = Arch(n_heads=cfg.num_attention_heads, n_kv_heads=cfg.num_key_value_heads, head_dim=head_dim,
                    eps=float(cfg.rms_norm_eps), scale=float(getattr(first, "scaling", head_dim ** -0.5)),
                    act=ACT2FN[cfg.hidden_act].forward, qk_norm=hasattr(first, "q_norm"))
        layers, names = [], []
        for i, layer in enumerate(base.layers[: cfg.num_hidden_layers]):
            att, mlp = layer.self_attn, layer.mlp
            wqkv, bqkv = fused(att.q_proj, att.k_proj, att.v_proj)
            wgu, bgu = fused(mlp.gate_proj, mlp.up_proj)
            if bgu is not None or mlp.down_proj.bias is not None:
                raise ValueError("MLP biases are not supported by the fast path")
            lw = {"ln_attn": layer.input_layernorm.weight.detach(), "wqkv": wqkv, "wo": att.o_proj.weight.detach(),
                  "ln_mlp": layer.post_attention_layernorm.weight.detach(), "wgu": wgu,
                  "wdown": mlp.down_proj.weight.detach()}
            if bqkv is not None:
                lw["bqkv"] = bqkv
            if att.o_proj.bias is not None:
                lw["bo"] = att.o_proj.bias.detach()
            if arch.qk_norm:
                lw["q_norm"], lw["k_norm"] = att.q_norm.weight.detach(), att.k_norm.weight.detach()
            layers.append(lw)
            names.append(projection_names(i))
        super().__init__(arch, base.embed_tokens.weight.detach(), layers, base.norm.weight.detach(),
                         model.lm_head.weight.detach(), windows=_windows(cfg),
                         rope_keys=["rope"] * len(layers), ropes={"rope": rope_of(base.rotary_emb)},
                         max_positions=int(cfg.max_position_embeddings), weights=weights, names=names,
                         weight_source=weight_source, wide=wide)
