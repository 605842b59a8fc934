"""Prompt lookup / n-gram drafting: find the latest earlier occurrence of the last n tokens (n from
max_n down to min_n) in prompt + output and propose what followed it. Costs no model call; proposals
are point masses (no draft probabilities).

Trees: several distinct continuations of the matched context become sibling branches. The matches are
ranked longest suffix first, then most recent first; the continuations are merged into a prefix tree
(shared prefixes share nodes), each new branch adding only the part where it diverges, so node order
(= sibling rank) follows match rank. A static shape keeps the nodes at its paths; a dynamic shape keeps
at most `topk` children per node and the first `budget` nodes in that order."""

from __future__ import annotations

import numpy as np
import torch

from verispec.errors import InvalidParameter
from verispec.drafters.base import Drafter
from verispec.types import Proposal, SamplingParams, StepResult


def find_continuation(context: list[int] | np.ndarray, k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """The up-to-k tokens that followed the latest earlier match of the longest matching suffix."""
    seq = np.asarray(context, dtype=np.int64)
    length = len(seq)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = seq[length - n:]
        # windows starting at i = 0 .. length-n-1 (the suffix itself, at length-n, is excluded)
        windows = np.lib.stride_tricks.sliding_window_view(seq[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return seq[start: start + k].tolist()
    return []


def find_continuations(context: list[int] | np.ndarray, depth: int, max_n: int = 3, min_n: int = 1,
                       limit: int = 16) -> list[list[int]]:
    """Up to `limit` distinct continuations (each up to `depth` tokens) of earlier matches of the
    context's suffix, best first: longer matched suffix, then more recent match."""
    seq = np.asarray(context, dtype=np.int64)
    length = len(seq)
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = seq[length - n:]
        windows = np.lib.stride_tricks.sliding_window_view(seq[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        for h in hits[::-1]:
            start = int(h) + n
            cont = tuple(seq[start: start + depth].tolist())
            if cont and cont not in seen:
                seen.add(cont)
                out.append(list(cont))
                if len(out) >= limit:
                    return out
    return out


class NGramDrafter(Drafter):
    name = "ngram"
    can_tree = True

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if min_n < 1 or max_n < min_n:
            raise InvalidParameter(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def begin(self, prompt: list[int], params: SamplingParams, generator: torch.Generator | None) -> None:
        pass

    def propose(self, context: list[int], k: int) -> Proposal | None:
        tokens = find_continuation(context, k, self.max_n, self.min_n)
        if not tokens:
            return None
        return Proposal(tokens=torch.tensor(tokens, dtype=torch.long))

    def propose_tree(self, context: list[int], shape) -> Proposal | None:
        from verispec.tree import Candidate, StaticTree, to_proposal

        static = isinstance(shape, StaticTree)
        if static:
            depth, branch_cap, budget = shape.depth, None, None
            limit = sum(1 for p in shape.paths if len(p) == shape.depth) + len(shape.paths)
        else:
            depth, branch_cap, budget = shape.depth, shape.topk, shape.budget or 16
            limit = budget
        conts = find_continuations(context, depth, self.max_n, self.min_n, limit=max(1, limit))
        cands: list[Candidate] = []
        child: dict[tuple[int, int], int] = {}   # (parent, token) -> node
        kids: dict[int, int] = {}                # node -> number of children
        path_of: dict[int, tuple[int, ...]] = {-1: ()}
        for cont in conts:
            parent = -1
            for d, tok in enumerate(cont, start=1):
                node = child.get((parent, tok))
                if node is None:
                    if (branch_cap is not None and kids.get(parent, 0) >= branch_cap) or \
                            (budget is not None and len(cands) >= budget):
                        break
                    node = len(cands)
                    cands.append(Candidate(tok, parent, depth=d))
                    path_of[node] = path_of[parent] + (kids.get(parent, 0),)
                    kids[parent] = kids.get(parent, 0) + 1
                    child[(parent, tok)] = node
                parent = node
        if static:
            wanted = set(shape.paths)
            keep = [i for i in range(len(cands)) if path_of[i] in wanted]
        else:
            keep = list(range(len(cands)))
        if not keep:
            return None
        return to_proposal(cands, keep)

    def observe(self, result: StepResult) -> None:
        pass
