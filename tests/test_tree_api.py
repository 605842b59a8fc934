"""Tree options through the Python API and the CLI, and the hardware-aware budget in the engine."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from conftest import loaded, tiny_llama
from verispec.api import build_engine, generate
from verispec.cli import app
from verispec.errors import InvalidParameter
from verispec.tree import DynamicTree, StaticTree, StepCosts, measure_verify_cost, tree_tokens
from verispec.tree.budget import EXPLORE, EXPLORE_MAX, EXPLORE_RUN
from verispec.types import SamplingParams


pytestmark = pytest.mark.usefixtures("one_thread")


def test_build_engine_tree_options():
    target = loaded(tiny_llama())
    e = build_engine(target, "ngram", tree="dynamic", tree_budget=10, tree_topk=2, tree_depth=3, backend="hf")
    assert e.tree == DynamicTree(budget=10, topk=2, depth=3)
    assert e.tree_shape(2) == DynamicTree(budget=10, topk=2, depth=2)  # cut to the room left
    e = build_engine(target, "ngram", tree="static:large", tree_depth=2, backend="hf")
    assert isinstance(e.tree, StaticTree) and e.tree.depth == 2
    with pytest.raises(InvalidParameter, match="needs a drafter"):
        build_engine(target, "ar", tree="dynamic", backend="hf")
    with pytest.raises(InvalidParameter):
        build_engine(target, "ngram", tree="static:nosuch", backend="hf")


def test_auto_budget_follows_the_cost_curve():
    target = loaded(tiny_llama())
    flat = build_engine(target, "ngram", tree="dynamic", tree_budget="auto", verify_cost={1: 1.0, 256: 1.0}, backend="hf")
    steep = build_engine(target, "ngram", tree="dynamic", tree_budget="auto", verify_cost={1: 1.0, 256: 256.0}, backend="hf")
    assert flat.tree_shape(6).budget == 63
    # a cost proportional to the positions: no tree pays, so a plain step (None), but after EXPLORE plain steps
    # in a row a run of EXPLORE_RUN one-node steps keeps measuring the acceptance, then after 2x, 4x, ... up
    # to EXPLORE_MAX
    shapes = [steep.tree_shape(6) for _ in range(7 * EXPLORE + 4 * EXPLORE_MAX + 7 * EXPLORE_RUN)]
    drafted = [i for i, s in enumerate(shapes) if s is not None]
    assert all(shapes[i].budget == 1 for i in drafted)
    runs = [drafted[i:i + EXPLORE_RUN] for i in range(0, len(drafted), EXPLORE_RUN)]
    assert all(r == list(range(r[0], r[0] + EXPLORE_RUN)) for r in runs)
    gaps = [b[0] - a[-1] for a, b in zip([[-1]] + runs, runs)]
    assert gaps == [EXPLORE, 2 * EXPLORE, 4 * EXPLORE] + [EXPLORE_MAX] * 4
    # a new generation (other text, its own acceptance counts) tries drafting after EXPLORE plain steps again
    steep.budget.new_generation()
    shapes = [steep.tree_shape(6) for _ in range(EXPLORE + EXPLORE_RUN)]
    assert [i for i, s in enumerate(shapes) if s is not None] == list(range(EXPLORE - 1, EXPLORE - 1 + EXPLORE_RUN))
    # and the other way: where trees pay, one plain step after EXPLORE trees in a row, then after 2x, ... (a plain
    # step's measured cost would otherwise never be refreshed)
    shapes = [flat.tree_shape(6) for _ in range(2 * EXPLORE + 4 * EXPLORE_MAX)]
    plain = [i for i, s in enumerate(shapes) if s is None]
    gaps = [b - a for a, b in zip([-1] + plain, plain)]
    assert gaps == [EXPLORE - 1, 2 * EXPLORE, 4 * EXPLORE] + [EXPLORE_MAX] * 3  # (one tree was asked for above)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    want = build_engine(target, backend="hf").generate(prompt, SamplingParams(max_new_tokens=24)).token_ids
    g = flat.generate(prompt, SamplingParams(max_new_tokens=12))
    assert g.token_ids == want[:12]
    steep = build_engine(target, "ngram", tree="dynamic", tree_budget="auto", verify_cost={1: 1.0, 256: 256.0}, backend="hf")
    steep.budget.step_costs.observe = lambda budget, seconds: None  # priced by the curve alone, not by the steps' times
    g = steep.generate(prompt, SamplingParams(max_new_tokens=24))
    assert g.token_ids == want and 0 < g.stats.tree_steps < g.stats.steps // 2, g.stats


def test_auto_budget_counts_what_drafting_costs():
    """The engine times whole steps and the auto budget weighs what a step costs beyond its forward: a drafter
    slow enough that one drafted node cannot pay for itself gets plain steps."""
    import time

    target = loaded(tiny_llama())
    e = build_engine(target, "ngram", tree="dynamic", tree_budget="auto", verify_cost={1: 1.0, 2: 1.1, 256: 256.0},
                     backend="hf")
    assert e.tree_shape(6).budget >= 1 and e.budget.step_costs.means == {}
    real = e.drafter.propose_tree

    def slow(context, shape):
        time.sleep(0.05)
        return real(context, shape)

    e.drafter.propose_tree = slow
    e.budget.verify_cost = {1: 0.01, 2: 0.011, 256: 2.56}  # a drafted node costs 0.001 s to verify, 0.05 s to draft
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    g = e.generate(prompt, SamplingParams(max_new_tokens=20))
    drafted = {b: s for b, s in e.budget.step_costs.means.items() if b > 0}
    assert drafted and min(drafted.values()) >= 0.03 and g.stats.tree_steps < g.stats.steps
    assert e.tree_shape(6) is None


def test_step_costs_count_steady_steps_only():
    """A drafted step right after a plain one also catches a feature drafter up with the plain steps' positions:
    StepCosts counts drafted steps only after a drafted step, plain steps after any step (not a generation's
    first), each beyond its forward on the cost curve."""
    target = loaded(tiny_llama())
    e = build_engine(target, "ngram", tree="dynamic", tree_budget="auto", verify_cost={1: 0.5, 4: 1.0, 256: 50.0},
                     backend="hf")
    e.budget.new_generation()
    for budget, positions, seconds in [(0, 1, 5.0), (3, 4, 9.0), (3, 4, 2.0), (0, 1, 0.75), (3, 4, 7.0), (3, 4, 3.0),
                                       (0, 1, 0.1)]:
        e.budget.chosen = budget  # as choose sets it
        e.budget.observe(positions, seconds)
    costs = e.budget.step_costs
    assert costs.plain() == pytest.approx(0.8 * 0.25 + 0.2 * -0.4)  # faster than the curve: below 0
    assert costs.means[3] == pytest.approx(0.8 * 1.0 + 0.2 * 2.0)  # the first step and those after a plain one left out
    assert costs.drafting(3) == costs.drafting(1) == costs.drafting(63) == costs.means[3]
    costs.observe(15, 4.0)
    assert costs.drafting(7) == costs.means[3] and costs.drafting(31) == 4.0  # the nearest measured, smaller on a tie


def test_auto_budget_builds_its_trees_again_only_when_the_acceptance_changes():
    """Plain steps count no acceptance, so the expected tokens of every candidate budget's tree (pure Python
    over optimal trees) are built at most once per drafted step, plus the first; a new cost curve is priced
    at once."""
    target = loaded(tiny_llama())
    e = build_engine(target, "ngram", tree="dynamic", tree_budget="auto",
                     verify_cost={1: 0.01, 2: 0.05, 256: 12.8}, backend="hf")  # a node never pays: plain steps
    e.budget.step_costs.observe = lambda budget, seconds: None  # priced by the curve alone, not by the steps' times
    tree_tokens.cache_clear()
    g = e.generate([1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_new_tokens=30))
    candidates = 6  # AUTO_BUDGETS but the plain step
    assert g.stats.steps >= 20 and tree_tokens.cache_info().misses <= candidates * (1 + g.stats.tree_steps)
    assert g.stats.tree_steps >= 1  # the exploration still drafts now and then
    e.budget.verify_cost = {1: 0.01, 2: 0.0101, 256: 2.56}  # another cost curve: chosen again, now drafting
    assert e.tree_shape(6) is not None


def test_measure_verify_cost_leaves_the_runner_clean():
    target = loaded(tiny_llama())
    e = build_engine(target, "ngram", tree="dynamic", tree_budget="auto", backend="hf")
    cost = measure_verify_cost(e.runner, sizes=(1, 4), context=16, repeats=1)
    assert set(cost) == {1, 4} and all(v > 0 for v in cost.values()) and e.runner.length == 0


def test_generate_with_tree_kwargs():
    target = loaded(tiny_llama())
    g = generate(target, "1 2 3 1 2 3 1 2", method="ngram", tree="static:small", max_new_tokens=10, backend="hf")
    assert g.stats.tree == StaticTree.named("small").describe() and len(g.token_ids) == 10


@pytest.mark.parametrize("args,message", [
    (["--tree", "static:nosuch"], "unknown static tree"),
    (["--tree-budget", "8"], "need --tree"),
    (["--tree", "dynamic", "--tree-budget", "lots"], "tree budget"),
])
def test_cli_bad_tree_options(args, message):
    res = CliRunner().invoke(app, ["generate", "hello", "--method", "ngram", *args])
    assert res.exit_code == 2 and message in res.output


@pytest.mark.real_model
def test_cli_generate_with_tree(smollm2):
    res = CliRunner().invoke(app, ["generate", "1, 2, 3, 4, 1, 2, 3, 4, 1, 2,", "--method", "ngram", "--tree", "dynamic",
                                   "--tree-budget", "12", "-n", "12", "--backend", "hf", "--compare"])
    assert res.exit_code == 0, res.output
    assert "nodes/step" in res.output and "identical to plain decoding" in res.output
