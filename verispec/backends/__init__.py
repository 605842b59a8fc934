"""Target backends behind one Runner contract (base.py), and the one place that picks one for a model.

    runner = make_runner(model, backend="auto")   # fast.FastRunner when the family has a fast module,
                                                  # else transformers.HFRunner
    scores = forward_many([(runner_a, call_a), (runner_b, call_b)])   # several sequences, shared forwards
"""

from __future__ import annotations

from verispec.backends.base import Forward, Runner, Scores, TreeMask
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


def forward_many(calls: list[tuple[Runner, Forward]]) -> list[Scores]:
    """Each runner's Forward scored, in order: the calls whose runners give equal `batch_key`s share
    forwards (their class's `Runner.forward_together`), the others run alone. Each runner appears once."""
    out: list[Scores | None] = [None] * len(calls)
    groups: dict = {}
    for i, (runner, call) in enumerate(calls):
        groups.setdefault(runner.batch_key(call) or ("alone", i), []).append(i)
    for key, idx in groups.items():
        if len(idx) == 1:  # alone: the runner's own forward (the fast backend's native whole-stack call)
            runner, call = calls[idx[0]]
            out[idx[0]] = runner.forward(call.ids, tree=call.tree, features=call.features)
            continue
        runners = [calls[i][0] for i in idx]
        for i, scores in zip(idx, type(runners[0]).forward_together(runners, [calls[i][1] for i in idx])):
            out[i] = scores
    return out


__all__ = ["BACKENDS", "Forward", "Runner", "Scores", "TreeMask", "forward_many", "make_runner"]
