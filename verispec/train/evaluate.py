"""Held-out evaluation of a trained head: mean accepted length (tau) through the engine, greedy, on
prompts not trained on (the held-out ShareGPT slice of data.py), plus plain decoding for the speed ratio."""

from __future__ import annotations

import time

from verispec.engine import Engine
from verispec.types import SamplingParams


def evaluate_tau(target, drafter, prompts: list[str], max_new_tokens: int = 64, draft_length: int = 4, tree=None,
                 backend: str = "auto", check_exact: bool = True) -> dict:
    """-> {"tau", "alpha", "prompts", "tokens", "seconds", "ar_seconds", "exact"}."""
    engine = Engine.for_model(target, drafter, draft_length=draft_length, tree=tree, backend=backend)
    plain = Engine.for_model(target, None, backend=backend)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    steps = tokens = drafted = accepted = 0
    secs = ar_secs = 0.0
    exact = True
    for text in prompts:
        ids = target.encode(chat=text)
        t0 = time.perf_counter()
        g = engine.generate(ids, params)
        secs += time.perf_counter() - t0
        steps += g.stats.steps
        tokens += g.stats.committed
        drafted += g.stats.drafted
        accepted += g.stats.accepted
        if check_exact:
            t0 = time.perf_counter()
            exact &= plain.generate(ids, params).token_ids == g.token_ids
            ar_secs += time.perf_counter() - t0
    return {"tau": round(tokens / max(1, steps), 3), "alpha": round(accepted / max(1, drafted), 3),
            "prompts": len(prompts), "tokens": tokens, "seconds": round(secs, 1),
            "ar_seconds": round(ar_secs, 1) if check_exact else None, "exact": exact if check_exact else None}
