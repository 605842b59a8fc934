"""Tree options through the Python API and the CLI, and the hardware-aware budget in the engine."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from conftest import loaded, tiny_llama
from verispec.api import build_engine, generate
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
    assert flat.tree_shape(6).budget == 63 and steep.tree_shape(6).budget == 1
    g = flat.generate([1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_new_tokens=12))
    assert g.token_ids == build_engine(target, backend="hf").generate([1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_new_tokens=12)).token_ids


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
