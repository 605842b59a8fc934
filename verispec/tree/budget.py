"""The node budget from hardware (Sequoia, Chen et al. 2024): `choose_budget` maximises expected
accepted tokens per second, from a measured cost curve (seconds per forward over N positions:
`measure_verify_cost` here, `verispec roofline` more carefully; theory.CostCurve reads it), an
acceptance-by-rank profile, which `RankAcceptance` keeps up to date from the steps of a generation, and
what a step costs beyond its forward, which `StepCosts` measures on whole steps. `AutoBudget` is the
engine's one object for all of it: `choose` the budget of a step, `observe` what the step cost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Mapping, Sequence

import torch

from verispec.theory import CostCurve
from verispec.tree.layout import TreeLayout, count_ranks
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

    Only steady steps count (AutoBudget.observe decides): not a generation's first step, and not a drafted
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


# the auto budget's choices: a plain step (0: not drafting is expected to pay more) or a tree of so many nodes
AUTO_BUDGETS = (0, 1, 3, 7, 15, 31, 63)
EXPLORE, EXPLORE_MAX = 8, 64  # steps of one kind (plain or drafted) in a row after which the auto budget tries
#                               the other (to keep measuring the acceptance and both kinds' costs), doubling
#                               while the other keeps not paying
EXPLORE_RUN = 2  # drafted steps in a row when it tries drafting: the first catches a feature drafter up with
#                  the plain steps' positions, the second is a steady step whose cost StepCosts can count


class AutoBudget:
    """The auto tree budget (a dynamic tree without a fixed node count): each step `choose` gives the nodes
    to draft (0: a plain step), `observe` learns what the step cost, `observe_acceptance` which sibling
    ranks its tree had accepted.

    It prices every budget in AUTO_BUDGETS with choose_budget: `verify_cost` (positions -> seconds of a
    forward; None until measured or given: the engine measures it before a generation's prefill), the
    acceptance by rank (RankAcceptance, learned across generations, each generation with its own counts)
    and what a step costs beyond its forward (StepCosts). Since a kind of step not taken teaches nothing
    (a plain step no acceptance, either kind its own cost), after EXPLORE steps of one kind in a row it
    takes the other: a run of EXPLORE_RUN one-node steps, or one plain step; then after twice as many (up
    to EXPLORE_MAX) while its choice stays."""

    def __init__(self, verify_cost: dict[int, float] | None = None):
        self.verify_cost = verify_cost  # what it prices forwards with; set another to price with it
        self.rank_acceptance = RankAcceptance()
        self.step_costs = StepCosts()
        self.chosen: int | None = None  # the budget of the step in progress (None: none chosen)
        self._curve: tuple[int, CostCurve] | None = None  # verify_cost as a CostCurve (keyed by its id)
        self._last: int | None = None  # the budget of the step before it in this generation
        self._drafting = False  # the kind of step chosen last (True: a tree)
        self._streak = 0  # steps of that kind in a row
        self._explore = EXPLORE  # ... after which it tries the other kind
        self._forced = 0  # drafted steps of such a try still to come

    def new_generation(self) -> None:
        """A generation begins: no step of it before the next (the step costs stay, the acceptance estimate
        starts this generation's own counts, and the other kind of step comes after EXPLORE steps again, so
        that those counts come soon)."""
        self.chosen = self._last = None
        self.rank_acceptance.new_generation()
        self._streak, self._explore = 0, EXPLORE

    def choose(self, max_depth: int) -> int:
        """The nodes to draft this step (0: a plain step) for trees at most `max_depth` deep."""
        if self._forced:
            budget, self._forced = 1, self._forced - 1
        else:
            costs = self.step_costs
            budget = choose_budget(self.rank_acceptance.profile(), self.cost_curve(), AUTO_BUDGETS,
                                   draft_cost=costs.drafting, max_depth=max_depth, plain_cost=costs.plain()).budget
            if (budget > 0) != self._drafting:
                self._drafting, self._streak, self._explore = budget > 0, 0, EXPLORE
            self._streak += 1
            if self._streak >= self._explore:
                self._streak, self._explore = 0, min(2 * self._explore, EXPLORE_MAX)
                budget, self._forced = (0, 0) if self._drafting else (1, EXPLORE_RUN - 1)
        self.chosen = budget
        return budget

    def observe_acceptance(self, layout: TreeLayout, accepted_nodes: Sequence[int]) -> None:
        """A drafted step's verdict: the sibling ranks offered along the accepted path, and the one taken."""
        for offered, rank in layout.walk_ranks(accepted_nodes):
            self.rank_acceptance.observe(offered, rank)

    def observe(self, positions: int, seconds: float) -> None:
        """A single sequence's whole step took `seconds` and verified `positions`: what it cost beyond its
        forward on the cost curve goes to StepCosts under the budget chosen for it, for steady steps only:
        not a generation's first, nor a drafted step right after a plain one (StepCosts says why). A batch's
        steps are not observed: their forward is shared, and the batch's share of positions bounds each
        sequence's tree. A step with no budget chosen (a fixed tree, a free proposal) teaches nothing and
        makes the next step a first one."""
        budget, self.chosen = self.chosen, None
        if budget is not None and self._last is not None and (budget == 0 or self._last > 0):
            # may be below 0 (a curve measured while the machine was busier, or given for another one): the
            # curve plus it is then still the step's measured time
            self.step_costs.observe(budget, seconds - self.cost_curve().seconds(positions))
        self._last = budget

    def cost_curve(self) -> CostCurve:
        """verify_cost as a CostCurve, built once per cost dict."""
        if self._curve is None or self._curve[0] != id(self.verify_cost):
            cost = self.verify_cost
            self._curve = (id(cost), CostCurve(list(cost), list(cost.values())))
        return self._curve[1]
