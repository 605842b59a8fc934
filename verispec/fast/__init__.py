"""The fast path's models: a compact forward of our own for the Llama family and Gemma 3 over a
preallocated static KV cache (the runner over them is verispec.backends.fast.FastRunner), built once per
model and weight setting and shared by its runners."""

from __future__ import annotations

import threading
import weakref

import torch

from verispec.errors import UnsupportedModel


def _family(model):
    """(the fast family module, its model class name) for `model`, or None."""
    from verispec.fast import gemma3, llama

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return next(((mod, cls) for mod, cls in ((llama, "FastLlama"), (gemma3, "FastGemma3"))
                 if model_type in mod.MODEL_TYPES), None)


def unsupported_reason(model) -> str | None:
    """None when the fast path can run `model`, else a one-line reason."""
    family = _family(model)
    if family is None:
        return (f"model type {getattr(getattr(model, 'config', None), 'model_type', None)!r} is not supported "
                "(Llama family, Qwen2/3, Mistral, Gemma 3)")
    return family[0].unsupported_reason(model)


def supports(model) -> bool:
    return unsupported_reason(model) is None


def build_fast_model(model, **weight_options):
    """The fast family module for a loaded transformers model, or UnsupportedModel saying why not.
    weight_options: weights ("bf16", "q8", "q4"), weight_source and wide (see FastDecoder)."""
    reason = unsupported_reason(model)
    if reason:
        raise UnsupportedModel(f"fast backend: {reason}; use backend 'hf'")
    mod, cls = _family(model)
    return getattr(mod, cls)(model, **weight_options)


# Runners of one model share its fast module: the fused and packed (or quantized) weights, a copy as
# large as the model, are built once per model and weight setting, and each runner adds only its KV
# cache. Keyed weakly by the transformers model; the key also holds the kernels packed.py picks now
# (VERISPEC_PACKED, a test forcing the bf16 hybrid) and the parameters' version counters, so a model
# changed in place gets a fresh module.
_SHARED: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


def shared_fast_model(model, weights: str = "bf16", weight_source=None, wide: bool = True):
    """build_fast_model(model, ...), built once per model and setting and shared by its runners."""
    from verispec.fast import packed

    p = next(model.parameters())
    source = getattr(weight_source, "__self__", weight_source)  # a bound method is new on every access
    version = sum(t._version for t in model.parameters())
    key = (weights, id(source) if source is not None else None, wide, packed.linear_for(p.dtype, p.device), version)
    with _SHARED_LOCK:
        built = {k: v for k, v in _SHARED.get(model, {}).items() if k[-1] == version}  # stale ones go
        if key not in built:
            built[key] = build_fast_model(model, weights=weights, weight_source=weight_source, wide=wide)
        _SHARED[model] = built
        return built[key]


__all__ = ["UnsupportedModel", "build_fast_model", "shared_fast_model", "supports", "unsupported_reason"]
