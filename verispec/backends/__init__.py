"""Target backends behind one Runner contract (base.py), and the one place that picks one for a model.

    runner = make_runner(model, backend="auto")   # fast.FastRunner when the family has a fast module,
                                                  # else transformers.HFRunner
"""

from __future__ import annotations

from verispec.backends.base import Runner, Scores, TreeMask
from verispec.errors import InvalidParameter

BACKENDS = ("auto", "hf", "fast")


def make_runner(model, backend: str = "auto", **fast_options) -> Runner:
    """A runner for `model`: "fast" (FastRunner, UnsupportedModel if the family has no fast module),
    "hf" (transformers with a DynamicCache) or "auto" (fast when supported, else hf). fast_options go
    to FastRunner (exact, compile, weights, capacity, ...)."""
    from verispec.fast import supports

    if backend not in BACKENDS:
        raise InvalidParameter(f"unknown backend '{backend}'; use one of {', '.join(BACKENDS)}")
    if backend == "hf" or (backend == "auto" and not supports(model)):
        from verispec.backends.transformers import HFRunner

        return HFRunner(model)
    from verispec.backends.fast import FastRunner

    return FastRunner(model, **fast_options)


__all__ = ["BACKENDS", "Runner", "Scores", "TreeMask", "make_runner"]
