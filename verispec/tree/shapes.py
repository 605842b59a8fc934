"""Tree shapes: what a drafter is asked to fill.

  StaticTree   a fixed list of paths, Medusa style: the path (0, 2) is "the third-best child of the
               best child of the root". The defaults are the top-N paths under an assumed acceptance
               profile by sibling rank (see `optimal_paths`), the tree that maximises the expected
               accepted length for N nodes when each rank's acceptance is independent of depth.
  DynamicTree  built per step from the draft's own probabilities (EAGLE-2, Li et al. 2024): depth by
               depth expand the top-k children of the top-k nodes by cumulative draft probability, then
               keep the `budget` best nodes overall.

`parse_tree` reads both from the API/CLI forms.
"""

from __future__ import annotations

import heapq
import numbers
from dataclasses import dataclass
from typing import Sequence

from verispec.errors import InvalidParameter


Path = tuple[int, ...]

# acceptance probability of the r-th ranked candidate among siblings, assumed independent of depth: a
# profile typical of a small draft model or n-gram lookup on chat text (the top candidate wins most of
# the time, the next few pick up a small share). Used to build the default static trees.
DEFAULT_RANK_ACCEPTANCE = (0.62, 0.12, 0.05, 0.03, 0.02, 0.01)


def optimal_paths(rank_accept: Sequence[float], budget: int, max_depth: int = 8) -> list[Path]:
    """The `budget` paths with the largest product of rank acceptances, in topological order.

    Under the model "the r-th sibling is the accepted one with probability a_r, independently at each
    depth", a node is reached with probability prod(a_r on its path), so the expected number of accepted
    tokens is the sum of that over the tree's nodes, and the best N-node tree is simply the N most
    probable paths (a child is never more probable than its parent or its better-ranked sibling, so the
    set is closed under ancestors and better ranks). This is the positional-acceptance objective of
    Sequoia (Chen et al. 2024), solved greedily.
    """
    if budget < 1:
        raise InvalidParameter(f"tree budget must be >= 1, got {budget}")
    a = [float(x) for x in rank_accept if x > 0]
    if not a:
        raise InvalidParameter("rank acceptance profile must contain a positive value")
    heap: list[tuple[float, Path]] = [(-a[0], (0,))]
    chosen: list[tuple[float, Path]] = []
    while heap and len(chosen) < budget:
        neg, path = heapq.heappop(heap)
        chosen.append((-neg, path))
        prob = -neg
        if path[-1] + 1 < len(a):  # next sibling
            sib = path[:-1] + (path[-1] + 1,)
            parent_prob = prob / a[path[-1]]
            heapq.heappush(heap, (-parent_prob * a[path[-1] + 1], sib))
        if len(path) < max_depth:  # first child
            heapq.heappush(heap, (-prob * a[0], path + (0,)))
    return sort_paths([p for _, p in chosen])


def expected_accepted(rank_accept: Sequence[float], paths: Sequence[Path]) -> float:
    """Expected accepted draft tokens of a static tree under the rank-acceptance model."""
    total = 0.0
    for path in paths:
        prob = 1.0
        for r in path:
            prob *= rank_accept[r] if r < len(rank_accept) else 0.0
        total += prob
    return total


def sort_paths(paths: Sequence[Sequence[int]]) -> list[Path]:
    return sorted({tuple(int(x) for x in p) for p in paths}, key=lambda p: (len(p), p))


# bounds of a static tree given as paths: a node's rank asks the drafter for that many siblings and
# every node is a row of the verification pass, so a request cannot make either unbounded
MAX_TREE_RANK = 63
MAX_TREE_DEPTH = 32
MAX_TREE_NODES = 128


def validate_paths(paths: Sequence[Sequence[int]]) -> list[Path]:
    """Sorted, deduplicated paths; every prefix of a path must be a path too; ranks, depth and node
    count within the bounds above."""
    try:
        paths = [list(p) for p in paths]
    except TypeError:
        raise InvalidParameter("tree paths must be a list of lists of ranks, e.g. [[0],[1],[0,0]]") from None
    for p in paths:
        if any(isinstance(x, bool) or not isinstance(x, numbers.Integral) for x in p):
            raise InvalidParameter(f"tree path {p!r} must hold integer ranks, e.g. [[0],[1],[0,0]]")
    out = sort_paths(paths)
    if not out:
        raise InvalidParameter("a static tree needs at least one path")
    if len(out) > MAX_TREE_NODES:
        raise InvalidParameter(f"a static tree may have at most {MAX_TREE_NODES} paths, got {len(out)}")
    have = set(out)
    for p in out:
        if not p or any(x < 0 for x in p):
            raise InvalidParameter(f"tree path {list(p)} must be a non-empty list of ranks >= 0")
        if max(p) > MAX_TREE_RANK or len(p) > MAX_TREE_DEPTH:
            raise InvalidParameter(f"tree path {list(p)} is out of bounds: ranks go up to {MAX_TREE_RANK} and "
                                   f"paths up to {MAX_TREE_DEPTH} long")
        if len(p) > 1 and p[:-1] not in have:
            raise InvalidParameter(f"tree path {list(p)} has no parent path {list(p[:-1])}")
    return out


STATIC_TREES: dict[str, list[Path]] = {
    "chain4": [(0,) * d for d in range(1, 5)],
    "small": optimal_paths(DEFAULT_RANK_ACCEPTANCE, 8),
    "medium": optimal_paths(DEFAULT_RANK_ACCEPTANCE, 16),
    "large": optimal_paths(DEFAULT_RANK_ACCEPTANCE, 32),
    "xl": optimal_paths(DEFAULT_RANK_ACCEPTANCE, 64),
}


@dataclass(frozen=True)
class StaticTree:
    """A fixed tree shape, a list of paths of sibling ranks (Medusa's format)."""

    paths: tuple[Path, ...]
    name: str = "custom"

    def __post_init__(self) -> None:
        object.__setattr__(self, "paths", tuple(validate_paths(self.paths)))

    @classmethod
    def named(cls, name: str) -> "StaticTree":
        if name not in STATIC_TREES:
            raise InvalidParameter(f"unknown static tree '{name}'; use one of {', '.join(STATIC_TREES)} or a list of paths")
        return cls(tuple(STATIC_TREES[name]), name)

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    def truncated(self, max_depth: int) -> "StaticTree":
        return StaticTree(tuple(p for p in self.paths if len(p) <= max_depth), self.name)

    def children_ranks(self) -> dict[Path, int]:
        """For each path (the root is ()), how many ranked children it needs (highest rank + 1)."""
        need: dict[Path, int] = {}
        for p in self.paths:
            need[p[:-1]] = max(need.get(p[:-1], 0), p[-1] + 1)
        return need

    def describe(self) -> str:
        return f"static:{self.name} ({len(self.paths)} nodes, depth {self.depth})"


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2 style: expand the top `topk` nodes of each depth by cumulative draft probability (each
    with its `topk` best children), up to `depth`, then keep the `budget` best nodes.

    budget None means "auto" (the default): chosen per step by the engine from the verification cost
    curve, because the best size is a property of the hardware and of the runner's mode: when exact
    mode ran every pass at 8 rows, 8 positions cost what 1 did and 17 cost three passes, so a fixed
    budget just past a pass boundary lost most of its speedup (docs/performance-notes.md).
    """

    budget: int | None = None
    topk: int = 4
    depth: int = 6

    def __post_init__(self) -> None:
        for label, value, high in (("budget", self.budget, MAX_TREE_NODES), ("top-k", self.topk, MAX_TREE_RANK + 1),
                                   ("depth", self.depth, MAX_TREE_DEPTH)):
            if value is None and label == "budget":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value <= high:
                raise InvalidParameter(f"tree {label} must be an integer in [1, {high}], got {value!r}")

    def describe(self) -> str:
        b = "auto" if self.budget is None else str(self.budget)
        return f"dynamic (budget {b}, top-k {self.topk}, depth {self.depth})"


TreeShape = StaticTree | DynamicTree


def parse_tree(spec, budget: int | str | None = None, topk: int | None = None,
               depth: int | None = None) -> TreeShape | None:
    """A tree shape from the API/CLI forms: None (a chain), a StaticTree/DynamicTree, "dynamic",
    "static:<name>" or a bare name of STATIC_TREES, "static:[[0],[1],[0,0]]" or a list of paths.
    budget (dynamic trees): nodes per step, or "auto" = chosen from the verification cost curve."""
    if spec is None or spec is False or spec in ("", "none", "chain"):
        return None
    if isinstance(spec, (StaticTree, DynamicTree)):
        return spec
    auto = budget == "auto"
    if isinstance(budget, str) and not auto:
        try:
            budget = int(budget)
        except ValueError:
            raise InvalidParameter(f"tree budget must be an integer or 'auto', got '{budget}'") from None
    if isinstance(spec, str):
        kind, sep, arg = spec.partition(":")
        if kind == "dynamic" and not arg:
            return DynamicTree(budget=None if auto or budget is None else budget,
                               topk=4 if topk is None else topk, depth=6 if depth is None else depth)
        if sep and kind != "static":
            raise InvalidParameter(f"unknown tree '{spec}'; use dynamic, static:<name> ({', '.join(STATIC_TREES)}) "
                                   "or static:[[0],[1],[0,0],...]")
        name = (arg or "medium") if sep else spec
        if name.startswith("["):
            import json

            try:
                spec = json.loads(name)
            except json.JSONDecodeError as exc:
                raise InvalidParameter(f"tree paths must be a JSON list of lists of ranks: {exc}") from None
        else:
            spec = StaticTree.named(name)
    if isinstance(spec, (list, tuple)):
        try:
            spec = StaticTree(tuple(tuple(p) for p in spec))
        except TypeError:
            raise InvalidParameter("tree paths must be a list of lists of ranks, e.g. [[0],[1],[0,0]]") from None
    if not isinstance(spec, StaticTree):
        raise InvalidParameter(f"cannot read a tree from {spec!r}")
    if budget is not None:
        raise InvalidParameter("a tree budget applies to dynamic trees only (a static tree's size is its paths)")
    return spec.truncated(depth) if depth else spec


