"""Tree layouts: from parent indices to the tensors one verification pass needs.

A tree is a list of parent indices in topological order (parent[i] < i; -1 = attached to the cached
context). A chain is the tree whose parent[i] = i - 1. Built once per step into:

  ancestor mask  BoolTensor [n, n]   mask[i, j] = node j is node i or one of its ancestors
  depths         LongTensor [n]      position id of node i = cached length + depths[i]
  retrieve       LongTensor [L, D+1] the node indices of each root-to-leaf path, padded with -1
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from verispec.errors import InvalidParameter


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




def count_ranks(offered: list, accepted: list, offered_ranks: int, accepted_rank: int | None) -> None:
    """Add one node's children to per-rank tallies (in place): ranks 0..offered_ranks-1 were offered, and
    accepted_rank (None: none) was taken; the lists grow as deeper ranks appear."""
    while len(offered) < offered_ranks:
        offered.append(0)
        accepted.append(0)
    for r in range(offered_ranks):
        offered[r] += 1
    if accepted_rank is not None:
        accepted[accepted_rank] += 1
