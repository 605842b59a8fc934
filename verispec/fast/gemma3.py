"""Gemma 3 (text) as one configurable fast module: interleaved sliding-window and global layers with
their own rotary tables, Gemma's (1 + w) RMSNorms around attention and MLP, q/k norms, the
query_pre_attn_scalar softmax scale, the sqrt(hidden) embedding scale, and final logit soft-capping
when the config sets it. The config's attn_logit_softcapping is ignored, as transformers' Gemma 3
attention ignores it (checked in transformers 5.24; Gemma 3 checkpoints ship it as None anyway).

Reads the weights of an already loaded transformers model; nothing of transformers' modeling code runs.
"""

from __future__ import annotations

from transformers.activations import ACT2FN

from verispec.fast.core import Arch, fused, projection_names, rope_of
from verispec.fast.decoder import FastDecoder

MODEL_TYPES = ("gemma3_text",)
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def unsupported_reason(model) -> str | None:
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in MODEL_TYPES:
        return f"model type {getattr(cfg, 'model_type', None)!r} is not Gemma 3 text"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention is not a causal LM"
    for params in (getattr(cfg, "rope_parameters", None) or {}).values():
        if params and params.get("rope_type", "default") not in STATIC_ROPE:
            return f"rope type {params.get('rope_type')!r} is not supported by the fast path"
    return None


class FastGemma3(FastDecoder):
    family = "gemma3"

    def __init__(self, model, weights: str = "bf16", weight_source=None, wide: bool = True):
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(reason)
        cfg, base = model.config, model.model
        arch = Arch(n_heads=cfg.num_attention_heads, n_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                    eps=float(cfg.rms_norm_eps), scale=float(cfg.query_pre_attn_scalar) ** -0.5,
                    act=ACT2FN[cfg.hidden_activation].forward, gemma_norm=True, sandwich=True, qk_norm=True)
        types = list(cfg.layer_types[: cfg.num_hidden_layers])
        layers, names = [], []
        for i, layer in enumerate(base.layers[: cfg.num_hidden_layers]):
            att, mlp = layer.self_attn, layer.mlp
            wqkv, bqkv = fused(att.q_proj, att.k_proj, att.v_proj)
            wgu, _ = fused(mlp.gate_proj, mlp.up_proj)
            lw = {"ln_attn": layer.input_layernorm.weight.detach(), "wqkv": wqkv, "wo": att.o_proj.weight.detach(),
                  "ln_post_attn": layer.post_attention_layernorm.weight.detach(),
                  "ln_mlp": layer.pre_feedforward_layernorm.weight.detach(), "wgu": wgu,
                  "wdown": mlp.down_proj.weight.detach(),
                  "ln_post_mlp": layer.post_feedforward_layernorm.weight.detach(),
                  "q_norm": att.q_norm.weight.detach(), "k_norm": att.k_norm.weight.detach()}
            if bqkv is not None:
                lw["bqkv"] = bqkv
            if att.o_proj.bias is not None:
                lw["bo"] = att.o_proj.bias.detach()
            layers.append(lw)
            names.append(projection_names(i))
        ropes = {t: rope_of(base.rotary_emb, prefix=f"{t}_") for t in set(types)}
        windows = [cfg.sliding_window if t == "sliding_attention" else None for t in types]
        super().__init__(arch, base.embed_tokens.weight.detach(), layers, base.norm.weight.detach(),
                         model.lm_head.weight.detach(), windows=windows, rope_keys=types, ropes=ropes,
                         embed_scale=float(cfg.hidden_size) ** 0.5,
                         final_softcap=getattr(cfg, "final_logit_softcapping", None),
                         max_positions=int(cfg.max_position_embeddings), weights=weights, names=names,
                         weight_source=weight_source, wide=wide)
