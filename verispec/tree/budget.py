"""The node budget from hardware (Sequoia, Chen et al. 2024): `choose_budget` maximises expected
accepted tokens per unit of verification time, from a measured cost curve (seconds per forward over N
positions: `measure_verify_cost` here, `verispec roofline` more carefully; theory.CostCurve reads it)
and an acceptance-by-rank profile, which `RankAcceptance` keeps up to date from the steps of a
generation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from verispec.theory import CostCurve
from verispec.tree.layout import count_ranks
from verispec.tree.shapes import DEFAULT_RANK_ACCEPTANCE, expected_accepted, optimal_paths


@dataclass
class BudgetChoice:
    budget: int
    table: list[tuple[int, float, float, float]]  # (budget, expected tokens/step, step seconds, tokens/s)


def choose_budget(rank_accept: Sequence[float], cost: Mapping[int, float] | CostCurve,
                  budgets: Sequence[int] = (1, 3, 7, 15, 31, 63),
                  draft_cost: Callable[[int], float] | float = 0.0, max_depth: int = 8) -> BudgetChoice:
    """The node budget that maximises expected tokens per second.

    Expected tokens per step for N nodes = 1 + expected accepted of the best N-node tree under the
    rank-acceptance model; a step costs one verification forward over N + 1 positions (the cost curve)
    plus the drafting cost (seconds, constant or a function of N).

    Budget 0 (when `budgets` holds it) is a plain step: one token for a one-position forward and no
    drafting, chosen where the drafting cost and the extra positions outweigh the expected acceptance.

    The default budgets are the sizes `measure_verify_cost` measures less the root, so each is priced
    by a measurement, not by interpolation: a runner that pads passes to a fixed bucket (exact mode
    where the kernels are not row-invariant) has a staircase cost curve, and a straight line between 8
    and 16 positions would price 9 as cheaper than it is.
    """
    curve = cost if isinstance(cost, CostCurve) else CostCurve(list(cost), list(cost.values()))
    rows = []
    for b in budgets:
        if b == 0:  # no drafting: a plain decoding step
            rows.append((0, 1.0, curve.seconds(1), 1.0 / curve.seconds(1) if curve.seconds(1) > 0 else float("inf")))
            continue
        tokens = 1.0 + expected_accepted(rank_accept, optimal_paths(rank_accept, b, max_depth))
        seconds = curve.seconds(b + 1) + (draft_cost(b) if callable(draft_cost) else draft_cost)
        rows.append((b, tokens, seconds, tokens / seconds if seconds > 0 else float("inf")))
    best = max(rows, key=lambda r: r[3])
    return BudgetChoice(best[0], rows)


@torch.inference_mode()
def measure_verify_cost(runner, sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), context: int = 128,
                        repeats: int = 3, vocab: int = 8) -> dict[int, float]:
    """Median seconds of one forward over n new positions after `context` cached tokens (a quick
    roofline probe on the runner itself; `verispec roofline` measures the same thing more carefully).
    Leaves the runner reset."""
    ids = [(7 * i + 3) % vocab for i in range(context + max(sizes))]
    runner.reset()
    runner.forward(ids[:context], last_only=True)
    runner.forward(ids[context: context + 1])  # warm-up
    runner.rollback(context)
    out = {}
    for n in sizes:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.forward(ids[context: context + n])
            times.append(time.perf_counter() - t0)
            runner.rollback(context)
        out[n] = sorted(times)[len(times) // 2]
    runner.reset()
    return out


@dataclass
class RankAcceptance:
    """Running estimate of a_r = P(the r-th sibling is the accepted one | it was offered), seeded with
    a prior worth `prior_weight` observations."""

    prior: Sequence[float] = DEFAULT_RANK_ACCEPTANCE
    prior_weight: float = 8.0
    offered: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def observe(self, offered_ranks: int, accepted_rank: int | None) -> None:
        count_ranks(self.offered, self.accepted, offered_ranks, accepted_rank)

    def profile(self) -> list[float]:
        n = max(len(self.prior), len(self.offered))
        out = []
        for r in range(n):
            prior = self.prior[r] if r < len(self.prior) else 0.0
            off = self.offered[r] if r < len(self.offered) else 0.0
            acc = self.accepted[r] if r < len(self.accepted) else 0.0
            out.append((acc + prior * self.prior_weight) / (off + self.prior_weight))
        return out
