"""EAGLE heads in the formats other engines load: vLLM's `speculators` format and the EAGLE-3 layout of
SGLang / SpecForge (and the EAGLE authors' checkpoints). Export writes one of them from a verispec head
folder; import turns one into a verispec head (config, tensors), so `--head` takes either.

How a verispec eagle head maps onto EAGLE-3 (Li et al. 2025; speculators 0.9.0 `Eagle3DraftModel`,
SGLang `LlamaForCausalLMEagle3`):

    verispec (layout "eagle3")   speculators                              SGLang / EAGLE layout
    fc                           fc.weight                                fc.weight
    norm_e  (on the embedding)   layers.0.input_layernorm.weight          midlayer.input_layernorm.weight
    norm_h  (on the hidden)      layers.0.hidden_norm.weight              midlayer.hidden_norm.weight
    q k v o                      layers.0.self_attn.{q,k,v,o}_proj.weight midlayer.self_attn.{q,k,v,o}_proj.weight
    ln2                          layers.0.post_attention_layernorm.weight midlayer.post_attention_layernorm.weight
    gate up down                 layers.0.mlp.{gate,up,down}_proj.weight  midlayer.mlp.{gate,up,down}_proj.weight
    norm, lm_head                norm.weight, lm_head.weight              norm.weight, lm_head.weight
    d2t (target ids)             d2t = target id - draft index, t2d = bool mask over the target vocabulary
    the target's embedding       embed_tokens.weight (written)            not written (SGLang shares the target's)
    feature_layers (transformers hidden_states indices h, h = output of layer h - 1)
                                 eagle_aux_hidden_state_layer_ids = h     eagle_config.eagle_aux_hidden_state_layer_ids
                                 (vLLM captures the stream entering      = h - 1 (SGLang captures the output of
                                 layer h)                                 layer h; it adds 1 itself)

Both engines treat draft index i as target token i + d2t[i] and build t2d from the same set, so the
export orders the draft vocabulary by target id (lm_head rows permuted with it): the logits over the
target vocabulary are unchanged. What EAGLE-3 has no place for is refused with one line (HeadMismatch):
verispec's own layout (an input projection `inp` and a norm `ln1` between the concatenation and the
attention, the residual taken from the projection), feature layer 0 or the last (transformers applies
the final norm to that one; the engines capture it before), and on import: more than one decoder layer,
norms before fc or on the output (norm_before_fc, fc_norm, norm_output), biases, an activation other than
SiLU, scaled or partial rotary embeddings, sliding windows, a Qwen3 layer (its q/k norms), and an
embedding that is not the target's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from verispec.errors import HeadMismatch

FORMATS = ("speculators", "eagle3")

# verispec parameter -> the name inside EAGLE-3's first decoder layer (None: top level, same name)
_LAYER = {"norm_e": "input_layernorm", "norm_h": "hidden_norm", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
          "v": "self_attn.v_proj", "o": "self_attn.o_proj", "ln2": "post_attention_layernorm",
          "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
_TOP = ("fc", "norm", "lm_head")
_PREFIX = {"speculators": "layers.0.", "eagle3": "midlayer."}


def foreign_format(path: str | Path) -> str | None:
    """'speculators' or 'eagle3' when the folder holds a head in that format, else None (verispec's own)."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return None
    try:
        config = json.loads(cfg.read_text())
    except json.JSONDecodeError as exc:
        raise HeadMismatch(f"'{cfg}' is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if "kind" in config:
        return None
    if "speculators_model_type" in config:
        return "speculators"
    if "draft_vocab_size" in config or any("Eagle3" in a for a in config.get("architectures") or []):
        return "eagle3"
    return None


# ---------------------------------------------------------------- export


def export_head(config: dict, tensors: dict[str, torch.Tensor], out: str | Path, fmt: str,
                embedding: torch.Tensor | None = None, verifier: str | None = None,
                dtype: torch.dtype = torch.bfloat16, speculative_tokens: int = 3) -> Path:
    """Write a verispec eagle head (its config.json dict and tensors) to `out` in format `fmt`.
    embedding: the target's input embedding (written into the speculators format, which carries it);
    verifier: the target's Hugging Face id or path, recorded for the engines (optional)."""
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        raise HeadMismatch(f"unknown export format '{fmt}'; use one of {', '.join(FORMATS)}")
    _exportable(config)
    if fmt == "speculators" and embedding is None:
        raise HeadMismatch("the speculators format carries the target's embedding; pass the target model")
    H = int(config["hidden_size"])
    d2t = tensors["d2t"].long()
    order = torch.argsort(d2t)
    ids = d2t[order]
    vocab = int(config["target"]["vocab_size"])
    if ids.unique().numel() != ids.numel() or int(ids[0]) < 0 or int(ids[-1]) >= vocab:
        raise HeadMismatch(f"the head's draft vocabulary is not a set of distinct target ids below {vocab}")
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    prefix = _PREFIX[fmt]
    out_t = {f"{prefix}{theirs}.weight": tensors[f"{ours}.weight"] for ours, theirs in _LAYER.items()}
    out_t.update({f"{name}.weight": tensors[f"{name}.weight"] for name in _TOP})
    out_t["lm_head.weight"] = out_t["lm_head.weight"][order]
    if fmt == "speculators":
        out_t["embed_tokens.weight"] = embedding
    out_t = {k: v.detach().to(dtype).contiguous().cpu() for k, v in out_t.items()}
    out_t["d2t"] = (ids - torch.arange(ids.numel())).contiguous()
    out_t["t2d"] = t2d

    layer = {"model_type": "llama", "vocab_size": vocab, "hidden_size": H,
             "intermediate_size": int(config["intermediate_size"]), "num_hidden_layers": 1,
             "num_attention_heads": int(config["num_heads"]), "num_key_value_heads": int(config["num_kv_heads"]),
             "head_dim": int(config["head_dim"]), "hidden_act": "silu", "rms_norm_eps": float(config.get("rms_norm_eps", 1e-5)),
             "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
             "max_position_embeddings": int(config.get("max_position_embeddings", 32768)),
             "rope_parameters": {"rope_type": "default", "rope_theta": float(config.get("rope_theta", 10000.0))}}
    layers = [int(i) for i in config["feature_layers"]]
    dname = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
    if fmt == "speculators":
        meta = {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
                "transformer_layer_config": layer, "draft_vocab_size": int(ids.numel()),
                "norm_before_residual": bool(config.get("norm_before_residual", False)), "norm_before_fc": False,
                "fc_norm": False, "norm_output": False, "target_hidden_size": None, "embed_requires_grad": False,
                "eagle_aux_hidden_state_layer_ids": layers, "tie_word_embeddings": False, "dtype": dname,
                "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                       "proposal_methods": [{"proposal_type": "greedy",
                                                             "speculative_tokens": int(speculative_tokens)}],
                                       "verifier": {"name_or_path": verifier, "architectures": _architectures(config)}}}
    else:
        if config.get("norm_before_residual"):
            raise HeadMismatch("this head takes its residual after hidden_norm (norm_before_residual), which "
                               "SGLang's EAGLE-3 layer does not do; export it with --to speculators")
        meta = {**{k: v for k, v in layer.items() if k != "rope_parameters"}, "architectures": ["LlamaForCausalLMEagle3"],
                "rope_theta": layer["rope_parameters"]["rope_theta"], "rope_scaling": None,
                "draft_vocab_size": int(ids.numel()), "torch_dtype": dname,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers], "use_aux_hidden_state": True}}
        if verifier:
            meta["base_model"] = verifier
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.safetensors.tmp"
    save_file(out_t, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    # where it came from, beside the engines' config (whose schema the engines validate)
    (out / "verispec_source.json").write_text(json.dumps({"target": config["target"], "feature_layers": layers,
                                                         "training": config.get("training")}, indent=2) + "\n")
    return out


def _architectures(config: dict) -> list[str]:
    arch = {"llama": "LlamaForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}.get(config["target"].get("model_type"))
    return [arch] if arch else []


def _exportable(config: dict) -> None:
    if config.get("kind") != "eagle":
        raise HeadMismatch(f"only eagle heads have an EAGLE-3 form; this is a {config.get('kind')!r} head")
    if config.get("layout", "verispec") != "eagle3":
        raise HeadMismatch("this head uses verispec's layout (a projection `inp` and a norm `ln1` between "
                           "[norm(embedding), norm(hidden)] and the attention, the residual taken from the projection); "
                           "EAGLE-3 feeds that concatenation to q/k/v directly with the hidden state as residual, so it "
                           "cannot be written as EAGLE-3; train one with: verispec train eagle --layout eagle3")
    if int(config.get("num_layers", 1)) != 1:
        raise HeadMismatch(f"this head has {config['num_layers']} layers; the EAGLE-3 forms written here hold one "
                           "(train one with --head-layers 1)")
    if int(config["hidden_size"]) != int(config["target"]["hidden_size"]):
        raise HeadMismatch("EAGLE-3's layer is as wide as the target; this head's hidden_size differs from the target's")
    L = int(config["target"]["num_hidden_layers"])
    bad = [i for i in config["feature_layers"] if not 1 <= int(i) <= L - 1]
    if bad:
        raise HeadMismatch(f"feature layer(s) {bad} cannot be named in EAGLE-3 (the engines capture the stream entering "
                           f"layers 1..{L - 1} of this {L}-layer target; index 0 is the embedding and {L} has the final "
                           "norm applied)")


# ---------------------------------------------------------------- import


def import_head(path: str | Path, target) -> tuple[dict, dict[str, torch.Tensor]]:
    """(verispec config, tensors) of an EAGLE-3 head in the speculators or SGLang/EAGLE format at
    `path`, checked against `target` (a verispec LoadedModel)."""
    from verispec.heads import target_identity

    path = Path(path)
    fmt = foreign_format(path)
    if fmt is None:
        raise HeadMismatch(f"'{path}' holds neither a speculators nor an EAGLE-3 checkpoint")
    meta = json.loads((path / "config.json").read_text())
    raw = _read_weights(path)
    where = f"the {fmt} head at '{path}'"
    have = target_identity(target)
    V, Ht, L = have["vocab_size"], have["hidden_size"], have["num_hidden_layers"]
    if fmt == "speculators":
        if meta.get("speculators_model_type") != "eagle3":
            raise HeadMismatch(f"{where} is a {meta.get('speculators_model_type')!r} speculator; verispec runs eagle3 ones")
        for flag in ("norm_before_fc", "fc_norm", "norm_output"):
            if meta.get(flag):
                raise HeadMismatch(f"{where} sets {flag}, a norm verispec's eagle head does not have")
        if meta.get("target_hidden_size") not in (None, Ht):
            raise HeadMismatch(f"{where} reads a target of hidden size {meta['target_hidden_size']}, not {Ht}")
        layer = dict(meta.get("transformer_layer_config") or {})
        ids = meta.get("eagle_aux_hidden_state_layer_ids")
        feature_layers = [int(i) for i in ids] if ids else [2, L // 2, L - 3]
        norm_before_residual = bool(meta.get("norm_before_residual", False))
        prefix = "layers.0."
        draft_vocab = int(meta.get("draft_vocab_size", layer.get("vocab_size", V)))
    else:
        layer = meta
        ids = (meta.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        feature_layers = [int(i) + 1 for i in ids] if ids else [2, L // 2, L - 3]
        norm_before_residual = False
        prefix = "midlayer." if any(k.startswith("midlayer.") for k in raw) else "layers.0."
        draft_vocab = int(meta.get("draft_vocab_size") or layer.get("vocab_size", V))
    _check_layer(layer, where, V, Ht)
    if any(k.startswith(("layers.1.", "midlayers.1.", "additional_layers.")) for k in raw):
        raise HeadMismatch(f"{where} has more than one decoder layer; verispec imports one-layer EAGLE-3 heads")
    if not all(1 <= i <= L for i in feature_layers):
        raise HeadMismatch(f"{where} reads target layers {feature_layers}, outside this {L}-layer target")

    def take(name: str) -> torch.Tensor:
        for key in (name, "model." + name):
            if key in raw:
                return raw[key]
        raise HeadMismatch(f"{where} has no tensor '{name}'")

    tensors = {f"{ours}.weight": take(f"{prefix}{theirs}.weight") for ours, theirs in _LAYER.items()}
    tensors.update({f"{name}.weight": take(f"{name}.weight") for name in _TOP})
    lm = tensors["lm_head.weight"]
    if lm.shape[0] != draft_vocab:
        raise HeadMismatch(f"{where}: lm_head has {lm.shape[0]} rows but draft_vocab_size is {draft_vocab}")
    if "d2t" in raw or "model.d2t" in raw:
        off = take("d2t").long()
        tensors["d2t"] = off + torch.arange(off.numel())
    elif draft_vocab == V:
        tensors["d2t"] = torch.arange(V)
    else:
        raise HeadMismatch(f"{where} has a draft vocabulary of {draft_vocab} tokens but no d2t map")
    embed = raw.get("embed_tokens.weight", raw.get("model.embed_tokens.weight"))
    if embed is not None:
        mine = target.model.get_input_embeddings().weight.detach().float().cpu()
        if embed.shape != mine.shape or not torch.allclose(embed.float(), mine, rtol=1e-2, atol=1e-2):
            raise HeadMismatch(f"{where} carries an embedding that is not '{target.name}''s; verispec drafts with the "
                               "target's own embedding")
    H = int(layer["hidden_size"])
    heads = int(layer["num_attention_heads"])
    rope = layer.get("rope_parameters") or {}
    config = {"kind": "eagle", "layout": "eagle3", "target": have, "feature_layers": feature_layers,
              "hidden_size": H, "num_heads": heads, "num_kv_heads": int(layer.get("num_key_value_heads") or heads),
              "head_dim": int(layer.get("head_dim") or H // heads), "intermediate_size": int(layer["intermediate_size"]),
              "draft_vocab_size": draft_vocab, "rms_norm_eps": float(layer.get("rms_norm_eps", 1e-6)),
              "rope_theta": float(rope.get("rope_theta", layer.get("rope_theta", 10000.0))),
              "max_position_embeddings": int(layer.get("max_position_embeddings", 32768)),
              "norm_before_residual": norm_before_residual, "imported": {"format": fmt, "path": str(path)}}
    return config, tensors


def _check_layer(layer: dict, where: str, V: int, Ht: int) -> None:
    if layer.get("model_type", "llama") != "llama":
        raise HeadMismatch(f"{where} has a {layer.get('model_type')!r} draft layer; verispec runs Llama-style ones "
                           "(no q/k norms)")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise HeadMismatch(f"{where} has {layer['num_hidden_layers']} decoder layers; verispec imports one-layer EAGLE-3 heads")
    if layer.get("attention_bias") or layer.get("mlp_bias") or layer.get("bias"):
        raise HeadMismatch(f"{where} has biases; verispec's eagle head has none")
    if layer.get("hidden_act", "silu") != "silu":
        raise HeadMismatch(f"{where} uses {layer['hidden_act']}; verispec's eagle head uses SiLU")
    rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default" or float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise HeadMismatch(f"{where} uses {rope.get('rope_type', rope.get('type'))!r} rotary scaling; verispec's eagle "
                           "head rotates with the plain frequencies")
    if any(t != "full_attention" for t in layer.get("layer_types") or []) or layer.get("use_sliding_window"):
        raise HeadMismatch(f"{where} uses sliding-window attention; verispec's eagle head attends to every position")
    if int(layer.get("vocab_size", V)) != V:
        raise HeadMismatch(f"{where} is for a target vocabulary of {layer['vocab_size']} tokens, not {V}")
    if int(layer["hidden_size"]) != Ht:
        raise HeadMismatch(f"{where} has hidden size {layer['hidden_size']}; the target's is {Ht}")


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if files:
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(str(f)))
        return out
    bins = sorted(path.glob("pytorch_model*.bin"))
    if bins:
        out = {}
        for f in bins:
            out.update(torch.load(f, map_location="cpu", weights_only=True))
        return out
    raise HeadMismatch(f"'{path}' has a config.json but no .safetensors or pytorch_model.bin weights")
