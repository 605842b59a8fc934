"""Tree options through the Python API and the CLI, and the hardware-aware budget in the engine."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from conftest import loaded, tiny_llama
from verispec.api import build_engine, generate
from verispec.engine import EXPLORE, EXPLORE_MAX
from verispec.cli import app
from verispec.errors import InvalidParameter
from verispec.tree import DynamicTree, StaticTree, measure_verify_cost
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
    # a cost proportional to the positions: no tree pays, so a plain step (None), but every EXPLORE-th step
    # in a row drafts one node to keep measuring the acceptance, then every 2x, 4x, ... up to EXPLORE_MAX
    shapes = [steep.tree_shape(6) for _ in range(7 * EXPLORE + 4 * EXPLORE_MAX)]
    drafted = [i for i, s in enumerate(shapes) if s is not None]
    assert all(shapes[i].budget == 1 for i in drafted)
    gaps = [b - a for a, b in zip([-1] + drafted, drafted)]
    assert gaps == [EXPLORE, 2 * EXPLORE, 4 * EXPLORE] + [EXPLORE_MAX] * 4
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    want = build_engine(target, backend="hf").generate(prompt, SamplingParams(max_new_tokens=24)).token_ids
    g = flat.generate(prompt, SamplingParams(max_new_tokens=12))
    assert g.token_ids == want[:12]
    steep = build_engine(target, "ngram", tree="dynamic", tree_budget="auto", verify_cost={1: 1.0, 256: 256.0}, backend="hf")
    g = steep.generate(prompt, SamplingParams(max_new_tokens=24))
    assert g.token_ids == want and 0 < g.stats.tree_steps < g.stats.steps // 2, g.stats


def test_auto_budget_counts_what_drafting_costs():
    """The engine times its dynamic-tree proposals (a running mean) and the auto budget weighs them: a drafter
    slow enough that one drafted node cannot pay for itself gets plain steps."""
    import time

    target = loaded(tiny_llama())
    e = build_engine(target, "ngram", tree="dynamic", tree_budget="auto", verify_cost={1: 1.0, 2: 1.1, 256: 256.0},
                     backend="hf")
    assert e.tree_shape(6).budget >= 1 and e.draft_seconds == 0
    real = e.drafter.propose_tree

    def slow(context, shape):
        time.sleep(0.05)
        return real(context, shape)

    e.drafter.propose_tree = slow
    e.verify_cost = {1: 0.01, 2: 0.011, 256: 2.56}  # a drafted node costs 0.001 s to verify, 0.05 s to draft
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    g = e.generate(prompt, SamplingParams(max_new_tokens=20))
    assert e.draft_seconds >= 0.05 and g.stats.tree_steps < g.stats.steps
    assert e.tree_shape(6) is None


def test_auto_budget_is_not_computed_again_while_its_inputs_stand(monkeypatch):
    """Plain steps change none of choose_budget's inputs (no acceptance counted, no proposal timed), so the
    engine computes the choice again only when they change: at most once per drafted step, plus the first."""
    import verispec.engine as engine_mod

    target = loaded(tiny_llama())
    e = build_engine(target, "ngram", tree="dynamic", tree_budget="auto",
                     verify_cost={1: 0.01, 2: 0.05, 256: 12.8}, backend="hf")  # a node never pays: plain steps
    calls = []
    real = engine_mod.choose_budget
    monkeypatch.setattr(engine_mod, "choose_budget", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = e.generate([1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_new_tokens=30))
    assert g.stats.steps >= 20 and len(calls) <= 1 + g.stats.tree_steps
    assert g.stats.tree_steps >= 1  # the exploration still drafts now and then, and its result is recomputed
    e.verify_cost = {1: 0.01, 2: 0.0101, 256: 2.56}  # another cost curve: chosen again, now drafting
    before = len(calls)
    assert e.tree_shape(6) is not None and len(calls) == before + 1


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
