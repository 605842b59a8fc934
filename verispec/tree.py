"""Draft trees: from parent indices to the tensors one verification pass needs, and tree shapes.

A tree is a list of parent indices in topological order (parent[i] < i; -1 = attached to the cached
context). A chain is the tree whose parent[i] = i - 1. Built once per step into:

  ancestor mask  BoolTensor [n, n]   mask[i, j] = node j is node i or one of its ancestors
  depths         LongTensor [n]      position id of node i = cached length + depths[i]
  retrieve       LongTensor [L, D+1] the node indices of each root-to-leaf path, padded with -1

Tree shapes (what a drafter is asked to fill):

  StaticTree   a fixed list of paths, Medusa style: the path (0, 2) is "the third-best child of the
               best child of the root". The defaults are the top-N paths under an assumed acceptance
               profile by sibling rank (see `optimal_paths`), the tree that maximises the expected
               accepted length for N nodes when each rank's acceptance is independent of depth.
  DynamicTree  built per step from the draft's own probabilities (EAGLE-2, Li et al. 2024): depth by
               depth expand the top-k children of the top-k nodes by cumulative draft probability, then
               keep the `budget` best nodes overall.

The node budget can be chosen from hardware (Sequoia, Chen et al. 2024): `choose_budget` maximises
expected accepted tokens per unit of verification time, from a measured cost curve (seconds per
forward over N positions, as `verispec roofline` measures) and an acceptance-by-rank profile, which
`RankAcceptance` keeps up to date from the steps of a generation.
"""

from __future__ import annotations

import heapq
import numbers
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from verispec.errors import InvalidParameter


# ----------------------------------------------------------------------------------------------------
# layout: parents -> mask, depths, retrieve indices


def check_parents(parents: Sequence[int]) -> list[int]:
    out = [int(p) for p in parents]
    for i, p in enumerate(out):
        if not -1 <= p < i:
            raise InvalidParameter(f"tree node {i} has parent {p}; parents must come before their children (-1 = root)")
    return out


def tree_depths(parents: Sequence[int]) -> torch.Tensor:
    """LongTensor [n]: 0 for a node attached to the context (-1), parent's depth + 1 otherwise."""
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return torch.tensor(depth, dtype=torch.long)


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """BoolTensor [n, n]: row i is True at i and at each of its ancestors."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


def children_lists(parents: Sequence[int]) -> list[list[int]]:
    """children[i]: the children of node i in index (= proposal) order."""
    kids: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents):
        if p >= 0:
            kids[p].append(i)
    return kids


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """Node indices from the top of the tree down to `node`, inclusive."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def retrieve_indices(parents: Sequence[int]) -> torch.Tensor:
    """LongTensor [leaves, max_depth + 1]: each root-to-leaf path's node indices, padded with -1."""
    kids = children_lists(parents)
    leaves = [i for i in range(len(parents)) if not kids[i]]
    paths = [path_to(parents, leaf) for leaf in leaves]
    width = max((len(p) for p in paths), default=0)
    out = torch.full((len(paths), width), -1, dtype=torch.long)
    for r, p in enumerate(paths):
        out[r, : len(p)] = torch.tensor(p, dtype=torch.long)
    return out


@dataclass
class TreeLayout:
    """Everything one verification pass needs, built once from the parents."""

    parents: list[int]
    mask: torch.Tensor      # BoolTensor [n, n]
    depths: torch.Tensor    # LongTensor [n]
    retrieve: torch.Tensor  # LongTensor [leaves, max_depth + 1]
    children: list[list[int]]

    @classmethod
    def from_parents(cls, parents: Sequence[int]) -> "TreeLayout":
        parents = check_parents(parents)
        return cls(parents, ancestor_mask(parents), tree_depths(parents), retrieve_indices(parents),
                   children_lists(parents))

    @classmethod
    def for_proposal(cls, proposal_parents: Sequence[int] | None, n_drafted: int) -> "TreeLayout":
        """The verification layout: node 0 = the pending root token, node i + 1 = drafted node i."""
        if proposal_parents is None:
            proposal_parents = list(range(-1, n_drafted - 1))
        if len(proposal_parents) != n_drafted:
            raise InvalidParameter(f"proposal has {n_drafted} tokens but {len(proposal_parents)} parents")
        return cls.from_parents([-1] + [int(p) + 1 for p in proposal_parents])

    def __len__(self) -> int:
        return len(self.parents)

    def walk_ranks(self, accepted_nodes: Sequence[int]) -> list[tuple[int, int | None]]:
        """For a verification walk (accepted proposal indices, root excluded): at each visited node
        with children, (how many children were offered, the rank of the accepted one or None)."""
        walk = [0] + [int(i) + 1 for i in accepted_nodes]
        out = []
        for j, node in enumerate(walk):
            kids = self.children[node]
            if not kids:
                continue
            nxt = walk[j + 1] if j + 1 < len(walk) else None
            out.append((len(kids), kids.index(nxt) if nxt is not None else None))
        return out


# ----------------------------------------------------------------------------------------------------
# static trees: lists of paths of sibling ranks


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
    mode ran every pass at 8 rows, 8 positions cost what 1 did and 17 cost three passes (measured
    2026-12-03, EAGLE on Spec-Bench: budget 7 1.01x, 15 0.67x, 16 0.50x).
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


# ----------------------------------------------------------------------------------------------------
# candidate trees as drafters build them, and choosing nodes from them


@dataclass
class Candidate:
    """One drafted node while a tree is being built. `q` is the distribution its token was drawn from
    (given its earlier siblings), or None for a deterministic choice (a point mass)."""

    token: int
    parent: int            # index into the candidate list, -1 = the pending root
    score: float = 1.0     # cumulative draft probability of the path (for dynamic selection)
    q: torch.Tensor | None = None
    depth: int = 1


def select_best(cands: Sequence[Candidate], budget: int) -> list[int]:
    """Indices of the `budget` best candidates by score, closed under ancestors, in creation order."""
    order = sorted(range(len(cands)), key=lambda i: (-cands[i].score, cands[i].depth, i))
    keep: set[int] = set()
    for i in order:
        if len(keep) >= budget:
            break
        chain = []
        j = i
        while j >= 0 and j not in keep:
            chain.append(j)
            j = cands[j].parent
        if len(keep) + len(chain) <= budget:
            keep.update(chain)
    return sorted(keep)


def to_proposal(cands: Sequence[Candidate], keep: Sequence[int] | None = None, vocab: int | None = None):
    """A Proposal (tokens, parents, draft_probs) from the kept candidates (creation order is topological).

    Point-mass candidates get a one-hot row when some other candidate has a q (a point mass IS the
    distribution of a deterministic draw); when none has, draft_probs is None."""
    from verispec.types import Proposal

    keep = list(range(len(cands))) if keep is None else list(keep)
    where = {c: i for i, c in enumerate(keep)}
    tokens = torch.tensor([cands[c].token for c in keep], dtype=torch.long)
    parents = [where[cands[c].parent] if cands[c].parent >= 0 else -1 for c in keep]
    probs = None
    if any(cands[c].q is not None for c in keep):
        v = vocab or next(cands[c].q.shape[-1] for c in keep if cands[c].q is not None)
        rows = []
        for c in keep:
            q = cands[c].q
            rows.append(q.float() if q is not None else torch.nn.functional.one_hot(torch.tensor(cands[c].token), v).float())
        probs = torch.stack(rows)
    return Proposal(tokens=tokens, draft_probs=probs, parents=parents)


# ----------------------------------------------------------------------------------------------------
# hardware-aware budget (Sequoia's idea): expected tokens per second from a cost curve


def interpolate_cost(cost: Mapping[int, float], n: int) -> float:
    """Seconds for one forward over n positions, linear between measured sizes, flat beyond the ends."""
    xs = sorted(cost)
    if not xs:
        raise InvalidParameter("the verification cost curve is empty")
    if n <= xs[0]:
        return cost[xs[0]]
    for lo, hi in zip(xs, xs[1:]):
        if n <= hi:
            w = (n - lo) / (hi - lo)
            return cost[lo] * (1 - w) + cost[hi] * w
    # beyond the largest measurement grow linearly with the last slope (compute-bound regime)
    if len(xs) >= 2:
        slope = (cost[xs[-1]] - cost[xs[-2]]) / (xs[-1] - xs[-2])
        return cost[xs[-1]] + slope * (n - xs[-1])
    return cost[xs[-1]]


@dataclass
class BudgetChoice:
    budget: int
    table: list[tuple[int, float, float, float]]  # (budget, expected tokens/step, step seconds, tokens/s)


def choose_budget(rank_accept: Sequence[float], cost: Mapping[int, float],
                  budgets: Sequence[int] = (1, 3, 7, 15, 31, 63),
                  draft_cost: Callable[[int], float] | float = 0.0, max_depth: int = 8) -> BudgetChoice:
    """The node budget that maximises expected tokens per second.

    Expected tokens per step for N nodes = 1 + expected accepted of the best N-node tree under the
    rank-acceptance model; a step costs one verification forward over N + 1 positions (the cost curve)
    plus the drafting cost (seconds, constant or a function of N).

    The default budgets are the sizes `measure_verify_cost` measures less the root, so each is priced
    by a measurement, not by interpolation: a runner that pads passes to a fixed bucket (exact mode
    where the kernels are not row-invariant) has a staircase cost curve, and a straight line between 8 and 16 positions would price 9 as
    cheaper than it is.
    """
    rows = []
    for b in budgets:
        tokens = 1.0 + expected_accepted(rank_accept, optimal_paths(rank_accept, b, max_depth))
        seconds = interpolate_cost(cost, b + 1) + (draft_cost(b) if callable(draft_cost) else draft_cost)
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
        while len(self.offered) < offered_ranks:
            self.offered.append(0.0)
            self.accepted.append(0.0)
        for r in range(offered_ranks):
            self.offered[r] += 1
        if accepted_rank is not None:
            self.accepted[accepted_rank] += 1

    def profile(self) -> list[float]:
        n = max(len(self.prior), len(self.offered))
        out = []
        for r in range(n):
            prior = self.prior[r] if r < len(self.prior) else 0.0
            off = self.offered[r] if r < len(self.offered) else 0.0
            acc = self.accepted[r] if r < len(self.accepted) else 0.0
            out.append((acc + prior * self.prior_weight) / (off + self.prior_weight))
        return out
