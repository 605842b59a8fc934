"""The fast path: a compact forward of our own for the Llama family and Gemma 3 over a preallocated
static KV cache, behind the same runner interface as the transformers path (verispec.runner.HFRunner).

    runner = make_runner(model, backend="auto")   # FastRunner when the family is supported, else HFRunner
"""

from __future__ import annotations

from verispec.errors import InvalidParameter, UnsupportedModel
from verispec.fast.runner import FastRunner, build_fast_model

BACKENDS = ("auto", "hf", "fast")


def unsupported_reason(model) -> str | None:
    """None when the fast path can run `model`, else a one-line reason."""
    from verispec.fast import gemma3, llama

    for mod in (llama, gemma3):
        if getattr(getattr(model, "config", None), "model_type", None) in mod.MODEL_TYPES:
            return mod.unsupported_reason(model)
    return f"model type {getattr(getattr(model, 'config', None), 'model_type', None)!r} has no fast module"


def supports(model) -> bool:
    return unsupported_reason(model) is None


def make_runner(model, backend: str = "auto", **fast_options):
    """A runner for `model`: "fast" (FastRunner, UnsupportedModel if the family has no fast module),
    "hf" (transformers with a DynamicCache) or "auto" (fast when supported, else hf)."""
    from verispec.runner import HFRunner

    if backend not in BACKENDS:
        raise InvalidParameter(f"unknown backend '{backend}'; use one of {', '.join(BACKENDS)}")
    if backend == "hf" or (backend == "auto" and not supports(model)):
        return HFRunner(model)
    return FastRunner(model, **fast_options)


__all__ = ["BACKENDS", "FastRunner", "UnsupportedModel", "build_fast_model", "make_runner", "supports",
           "unsupported_reason"]
