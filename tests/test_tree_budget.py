"""The auto tree budget alone (tree/budget.AutoBudget): its choice per step from a planted cost curve, what it
learns from the steps' planted times and verdicts, and its exploration of the kind of step it does not take."""

from __future__ import annotations

import pytest

from verispec.tree import AutoBudget, TreeLayout
from verispec.tree.budget import AUTO_BUDGETS, EXPLORE, EXPLORE_RUN

CHEAP_NODES = {1: 0.01, 2: 0.011, 256: 2.56}  # a drafted node costs 0.001 s to verify


def run_steps(budget: AutoBudget, n: int, beyond: dict[int, float]) -> list[int]:
    """n steps: each one's chosen budget, its time the forward on the curve plus beyond[drafted or not]."""
    chosen = []
    for _ in range(n):
        b = budget.choose(6)
        chosen.append(b)
        budget.observe(b + 1, budget.cost_curve().seconds(b + 1) + beyond[b > 0])
    return chosen


def test_a_flat_curve_drafts_the_largest_tree_and_a_steep_one_steps_plainly():
    assert AutoBudget({1: 1.0, 256: 1.0}).choose(8) == max(AUTO_BUDGETS)
    steep = AutoBudget({1: 1.0, 256: 256.0})
    chosen = [steep.choose(8) for _ in range(EXPLORE + EXPLORE_RUN)]
    # plain steps, until after EXPLORE of them in a row a run of one-node steps measures the acceptance
    assert chosen == [0] * (EXPLORE - 1) + [1] * EXPLORE_RUN + [0]


def test_a_drafter_that_costs_more_than_its_nodes_win_gets_plain_steps():
    budget = AutoBudget(dict(CHEAP_NODES))
    first = run_steps(budget, 3, {False: 0.0, True: 0.0})
    assert first[0] >= 1 and budget.step_costs.means == {first[1]: pytest.approx(0.0)}  # the first step is not counted
    budget.new_generation()
    chosen = run_steps(budget, 12, {False: 0.0, True: 0.05})  # drafting costs 0.05 s beyond the forward
    drafted = {b: s for b, s in budget.step_costs.means.items() if b > 0}
    assert drafted and min(drafted.values()) > 0.01 and budget.step_costs.plain() == pytest.approx(0.0, abs=1e-12)
    assert chosen[-1] == 0 and budget.choose(6) == 0
    # a curve priced again at once: another cost dict
    budget.verify_cost = {1: 0.01, 2: 0.0101, 256: 0.0102}
    assert budget.cost_curve().seconds(256) == pytest.approx(0.0102)


def test_steps_without_a_chosen_budget_teach_nothing():
    budget = AutoBudget(dict(CHEAP_NODES))
    budget.observe(1, 5.0)  # a step it chose nothing for (a free proposal, a fixed tree)
    budget.observe(1, 5.0)
    assert budget.step_costs.means == {}
    b = budget.choose(6)
    budget.observe(b + 1, 1.0)  # the first step with a budget: no step with one before it
    assert budget.step_costs.means == {}


def test_the_verdicts_move_this_generations_acceptance_and_the_pooled_one():
    budget = AutoBudget(dict(CHEAP_NODES))
    before, pooled = budget.rank_acceptance.profile(), budget.rank_acceptance.pooled()
    layout = TreeLayout.for_proposal([-1, -1, 0], 3)  # two siblings at the root, a child under the first
    for _ in range(20):
        budget.observe_acceptance(layout, [])  # nothing accepted: rank 0 offered and refused each time
    assert budget.rank_acceptance.profile()[0] < before[0] and budget.rank_acceptance.pooled()[0] < pooled[0]
    budget.new_generation()  # the generation's own counts start again; the pooled ones stay
    assert budget.rank_acceptance.profile() == pytest.approx(budget.rank_acceptance.pooled())
    assert budget.rank_acceptance.pooled()[0] < pooled[0]
