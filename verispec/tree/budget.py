"""The node budget from hardware (Sequoia, Chen et al. 2024): `choose_budget` maximises expected
accepted tokens per second, from a measured cost curve (seconds per forward over N positions:
`measure_verify_cost` here, `verispec roofline` more carefully; theory.CostCurve reads it), an
acceptance-by-rank profile, which `RankAcceptance` keeps up to date from the steps of a generation, and
what a step costs beyond its forward, which `StepCosts` measures on whole steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Mapping, Sequence

import torch

from verispec.theory import CostCurve
from verispec.tree.layout import count_ranks
from verispec.tree.shapes import DEFAULT_RANK_ACCEPTANCE, expected_accepted, optimal_paths


@dataclass
class BudgetChoice:
    budget: int
    table: list[tuple[int, float, float, float]]  # (budget, expected tokens/step, step seconds, tokens/s)


@lru_cache(maxsize=512)
def tree_tokens(rank_accept: tuple[float, ...], budget: int, max_depth: int) -> float:
    """Expected tokens a step commits with the best `budget`-node tree: 1 + its expected accepted drafts.
    Cached: the profile changes only on drafted steps, and building the trees is pure Python (its cost:
    docs/performance-notes.md)."""
    return 1.0 + expected_accepted(rank_accept, optimal_paths(rank_accept, budget, max_depth))


def choose_budget(rank_accept: Sequence[float], cost: Mapping[int, float] | CostCurve,
                  budgets: Sequence[int] = (1, 3, 7, 15, 31, 63),
                  draft_cost: Callable[[int], float] | float = 0.0, max_depth: int = 8,
                  plain_cost: float = 0.0) -> BudgetChoice:
    """The node budget that maximises expected tokens per second.

    Expected tokens per step for N nodes = 1 + expected accepted of the best N-node tree under the
    rank-acceptance model; a step costs one verification forward over N + 1 positions (the cost curve)
    plus `draft_cost`: what a drafted step costs beyond that forward (seconds, constant or a function of
    N: proposing, the tree mask, verifying, committing; StepCosts.drafting measures it).

    Budget 0 (when `budgets` holds it) is a plain step: one token for a one-position forward plus
    `plain_cost` (what a plain step costs beyond its forward, StepCosts.plain), chosen where the drafting
    cost and the extra positions outweigh the expected acceptance.

    The default budgets are the sizes `measure_verify_cost` measures less the root, so each is priced
    by a measurement, not by interpolation: a runner that pads passes to a fixed bucket (exact mode
    where the kernels are not row-invariant) has a staircase cost curve, and a straight line between 8
    and 16 positions would price 9 as cheaper than it is.
    """
    curve = cost if isinstance(cost, CostCurve) else CostCurve(list(cost), list(cost.values()))
    profile = tuple(float(x) for x in rank_accept)
    rows = []
    for b in budgets:
        if b == 0:  # no drafting: a plain decoding step
            tokens, seconds = 1.0, curve.seconds(1) + plain_cost
        else:
            tokens = tree_tokens(profile, b, max_depth)
            seconds = curve.seconds(b + 1) + (draft_cost(b) if callable(draft_cost) else draft_cost)
        rows.append((b, tokens, seconds, tokens / seconds if seconds > 0 else float("inf")))
    best = max(rows, key=lambda r: r[3])
    return BudgetChoice(best[0], rows)


@dataclass
class StepCosts:
    """What a step costs beyond its verification forward, measured on whole steps: the proposal (with a
    feature drafter's catch-up of its cache), the tree mask, verification, the commit, the features'
    copies, the text. Running means, one for plain steps and one per drafted budget (a deeper tree takes
    more drafter forwards). The parts are not timed one by one: a drafted step's costs are spread over
    the engine, the drafter and the runner, and a model of some of them misprices the step.

    A running mean below 0 says the cost curve overstates this machine's forwards now; the curve plus it is
    still the measured step.

    Only steady steps count (Engine.observe_step decides): not a generation's first step, and not a drafted
    step that follows a plain one, which also catches the drafter up with every position since it last
    drafted, a cost of switching that a run of drafted steps does not pay at each step."""

    weight: float = 0.2  # of the newest step in the running means
    means: dict[int, float] = field(default_factory=dict)  # budget (0: a plain step) -> seconds beyond its forward

    def observe(self, budget: int, seconds: float) -> None:
        old = self.means.get(budget)
        self.means[budget] = seconds if old is None else (1 - self.weight) * old + self.weight * seconds

    def plain(self) -> float:
        """A plain step (0 until one was measured)."""
        return self.means.get(0, 0.0)

    def drafting(self, budget: int) -> float:
        """A drafted step of `budget` nodes: its running mean, else the nearest budget's that was measured
        (the smaller on a tie), else 0. Pricing an unmeasured larger budget like a smaller one lets the
        choice try it and so measure it."""
        if budget in self.means:
            return self.means[budget]
        measured = [b for b in self.means if b > 0]
        return self.means[min(measured, key=lambda b: (abs(b - budget), b))] if measured else 0.0


@torch.inference_mode()
def measure_verify_cost(runner, sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), context: int = 128,
                        repeats: int = 3, vocab: int = 8) -> dict[int, float]:
    """Median seconds of one forward over n new positions after `context` cached tokens (a quick
    roofline probe on the runner itself; `verispec roofline` measures the same thing more carefully).
    Leaves the runner reset."""
    ids = [(7 * i + 3) % vocab for i in range(context + max(sizes))]
    runner.reset()
    runner.forward(ids[:context], last_only=True)
    for n in sizes:  # warm-up: a first pass of each size runs slower (buffers, page faults; docs/trees.md)
        runner.forward(ids[context: context + n])
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
    """Estimate of a_r = P(the r-th sibling is the accepted one | it was offered) for the text at hand.

    Pooled over every generation (seeded with a prior worth `prior_weight` observations), it is the prior of
    the current generation's own counts, worth `local_weight` observations: how predictable the target's
    text is differs several-fold between tasks (a head's first draft is accepted far more often in a
    worked sum than in a translation), so one pooled figure drafts where the text at hand is hard and
    declines where it is easy. `new_generation()` starts the local counts again."""

    prior: Sequence[float] = DEFAULT_RANK_ACCEPTANCE
    prior_weight: float = 8.0
    local_weight: float = 8.0
    offered: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    here_offered: list[float] = field(default_factory=list)
    here_accepted: list[float] = field(default_factory=list)

    def observe(self, offered_ranks: int, accepted_rank: int | None) -> None:
        count_ranks(self.offered, self.accepted, offered_ranks, accepted_rank)
        count_ranks(self.here_offered, self.here_accepted, offered_ranks, accepted_rank)

    def new_generation(self) -> None:
        self.here_offered, self.here_accepted = [], []

    def pooled(self) -> list[float]:
        """The estimate over every generation so far."""
        return _shrunk(self.accepted, self.offered, self.prior, self.prior_weight)

    def profile(self) -> list[float]:
        """The estimate for the current generation."""
        return _shrunk(self.here_accepted, self.here_offered, self.pooled(), self.local_weight)


def _shrunk(accepted: Sequence[float], offered: Sequence[float], prior: Sequence[float], weight: float) -> list[float]:
    """Per rank, (accepted + prior * weight) / (offered + weight): counts shrunk toward a prior."""
    out = []
    for r in range(max(len(prior), len(offered))):
        p = prior[r] if r < len(prior) else 0.0
        off = offered[r] if r < len(offered) else 0.0
        acc = accepted[r] if r < len(accepted) else 0.0
        out.append((acc + p * weight) / (off + weight))
    return out
