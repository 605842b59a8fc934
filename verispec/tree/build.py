"""Building a draft tree: one loop for every drafter that drafts from logits (draft model, EAGLE,
Medusa, the DFlash drafter), each scoring the nodes with its own model through a `Scorer`.

  static shape   level by level, each node of the shape gets its ranked children: the top-m tokens as
                 point masses when greedy; when sampling, m draws without replacement from q (row i = q
                 with the earlier siblings removed), which keeps verification exact because the shape
                 does not depend on the draws;
  dynamic shape  EAGLE-2: expand the `topk` best nodes of each depth by cumulative draft probability,
                 each with its `topk` best tokens as point masses (pruning by value would bias sampled
                 candidates; point masses are exact under any choice), then keep the `budget` best.

Candidates are kept in creation order, which is topological; `to_proposal` turns the kept ones into a
Proposal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from verispec.sampling import sample
from verispec.tree.shapes import DynamicTree, StaticTree


@dataclass
class Candidate:
    """One drafted node while a tree is being built. `q` is the distribution its token was drawn from
    (given its earlier siblings), or None for a deterministic choice (a point mass)."""

    token: int
    parent: int            # index into the candidate list, -1 = the pending root
    score: float = 1.0     # cumulative draft probability of the path (for dynamic selection)
    q: torch.Tensor | None = None
    depth: int = 1


def ancestors(cands: Sequence[Candidate], c: int) -> list[int]:
    """The drafted ancestors of candidate c, its parent first."""
    out, p = [], cands[c].parent
    while p >= 0:
        out.append(p)
        p = cands[p].parent
    return out


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


class Scorer(Protocol):
    """A drafter's side of tree building. Nodes are indices into the candidate list; -1 is the pending
    root, whose draft logits the drafter computed before building."""

    d2t: torch.Tensor | None  # the target id of each draft-vocabulary column; None: the column is the id

    def feed(self, cands: Sequence[Candidate], nodes: list[int]) -> None:
        """Run the drafter on these nodes (one depth; their ancestors were fed before), so that their
        children can be scored."""

    def child_logits(self, cands: Sequence[Candidate], nodes: list[int]) -> torch.Tensor:
        """Draft logits [len(nodes), V'] of each node's children (the root or fed nodes)."""

    def q_of(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [V'] -> the distribution to sample from, over the target vocabulary (the target's
        sampling transform)."""

    def ranking(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [n, V'] -> the probabilities that rank point-mass children."""


def sample_without_replacement(q: torch.Tensor, m: int, generator: torch.Generator | None):
    """Up to m distinct tokens drawn from q [V] -> [(token, q[token], the row it was drawn from)]: row i
    is q with the earlier draws removed, renormalised (what the tree acceptance rule expects)."""
    left, out = q.clone(), []
    for _ in range(m):
        total = left.sum()
        if total <= 0:
            break
        qi = left / total
        x = sample(qi, generator)
        out.append((x, float(q[x]), qi))
        left[x] = 0
    return out


def children(scorer: Scorer, cands: Sequence[Candidate], nodes: list[int], m: int, depth: int,
             sampled: bool = False, generator: torch.Generator | None = None) -> list[list[Candidate]]:
    """Up to m children of each node: sampled without replacement from q, or its top-m tokens as point
    masses (one softmax, one top-k and one copy to the host for all the nodes)."""
    lg = scorer.child_logits(cands, nodes)
    scores = [cands[c].score if c >= 0 else 1.0 for c in nodes]
    if sampled:
        return [[Candidate(x, c, s * p, qi, depth) for x, p, qi in sample_without_replacement(scorer.q_of(row), m, generator)]
                for row, c, s in zip(lg, nodes, scores)]
    vals, idx = scorer.ranking(lg).topk(min(m, lg.shape[-1]), dim=-1)
    toks = (idx if scorer.d2t is None else scorer.d2t[idx]).tolist()
    return [[Candidate(t, c, s * v, None, depth) for v, t in zip(vr, tr) if v > 0]
            for c, s, vr, tr in zip(nodes, scores, vals.tolist(), toks)]


def build_tree(scorer: Scorer, shape: StaticTree | DynamicTree, sampled: bool = False,
               generator: torch.Generator | None = None, prune: bool = True) -> tuple[list[Candidate], list[int]]:
    """The candidates of one tree and the indices of those to propose (creation order). sampled: draw a
    static tree's children from q (dynamic trees always rank point masses). prune: stop a dynamic tree
    once no deeper node can enter the `budget` best (a child scores at most its parent: same tree, less
    work). A static tree's nodes are scored one per call, a dynamic tree's a depth per call: a batched
    matmul's rows need not equal one-row results, so keeping each shape's batching keeps its tokens."""
    cands: list[Candidate] = []

    def add(kids: list[Candidate]) -> list[int]:
        cands.extend(kids)
        return list(range(len(cands) - len(kids), len(cands)))

    if isinstance(shape, StaticTree):
        need = shape.children_ranks()
        path_of: dict[int, tuple] = {-1: ()}
        level = [-1]
        for depth in range(1, shape.depth + 1):
            new = []
            for node in level:
                m = need.get(path_of[node], 0)
                if m:
                    for r, c in enumerate(add(children(scorer, cands, [node], m, depth, sampled, generator)[0])):
                        path_of[c] = path_of[node] + (r,)
                        new.append(c)
            grow = [c for c in new if need.get(path_of[c], 0) > 0]
            if grow:
                scorer.feed(cands, grow)
            level = new
        where = {p: c for c, p in path_of.items()}
        return cands, sorted(where[p] for p in shape.paths if p in where)
    if not isinstance(shape, DynamicTree):
        raise TypeError(f"unknown tree shape {shape!r}")
    budget = shape.budget or 16
    frontier = add(children(scorer, cands, [-1], shape.topk, 1)[0])
    for depth in range(2, shape.depth + 1):
        grow = sorted(frontier, key=lambda c: -cands[c].score)[: shape.topk]
        if not grow:
            break
        # a child scores at most its parent and ranks after every node of its score already there (deeper,
        # created later), so once the best frontier node is no better than the budget-th best candidate no
        # child can enter the budget (with budget 1 the best root child already holds it: no level follows)
        if prune and len(cands) >= budget:
            if cands[grow[0]].score <= sorted((c.score for c in cands), reverse=True)[budget - 1]:
                break
        scorer.feed(cands, grow)
        frontier = [c for kids in children(scorer, cands, grow, shape.topk, depth) for c in add(kids)]
    return cands, select_best(cands, budget)
