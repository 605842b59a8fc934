"""The runner contract: what the engine (and a draft model's drafter) needs from a target backend.

A runner is a causal LM with its KV cache. The engine resets it per generation, feeds tokens (a chain,
or a tree under an ancestor mask) and gets their logits and, when asked, hidden features back, then
commits the accepted path's slots. A chain is the tree whose nodes descend from the previous one, so a
chain's commit is a crop: `commit(start, [0, 1, .., m - 1])` keeps the first m slots from start.
Several runners' calls may share one forward (backends.forward_many): the runners whose `batch_key`s
are equal go to their class's `forward_together`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from verispec.errors import InvalidParameter


class TreeMask(NamedTuple):
    """Tree attention for one forward of n new nodes, written at slots length .. length + n - 1.

    mask:   BoolTensor [n, cols]  node i sees every slot before `start` and tree slot j iff mask[i, j]
            (True on its own diagonal entry); the tree slots are the cached ones from `start` on, then
            the n new nodes, so cols = length - start + n
    depths: LongTensor [cols]     a tree slot's position id is start + depth
    start:  int | None            the first tree slot; None = length (all the tree's nodes are new).
            Earlier: a drafter that grows one tree over several forwards
    """

    mask: torch.Tensor
    depths: torch.Tensor
    start: int | None = None

    def checked(self, n: int, length: int, device) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(start, mask, depths on `device`) for n new nodes after `length` cached slots, or ValueError."""
        start = length if self.start is None else int(self.start)
        cols = length - start + n
        mask = torch.as_tensor(self.mask, dtype=torch.bool).to(device)
        depths = torch.as_tensor(self.depths, dtype=torch.long).to(device).reshape(-1)
        if not 0 <= start <= length or mask.shape != (n, cols) or depths.numel() != cols:
            raise ValueError(f"tree of {n} new nodes over {cols} tree slots needs ancestor_mask [{n}, {cols}] "
                             f"and depths [{cols}], got {tuple(mask.shape)} and {tuple(depths.shape)}")
        return start, mask, depths


class Scores(NamedTuple):
    """What a forward returns: logits [n, V] ([1, V] with last_only) and the hidden features
    [n, len(features) * hidden] at the requested layers (None when none were requested)."""

    logits: torch.Tensor
    features: torch.Tensor | None = None


class Forward(NamedTuple):
    """One forward a generation step asks of its runner: ids [n] after the cached positions, their tree
    mask (None: a chain, causal), the feature layers to return."""

    ids: list[int]
    tree: TreeMask | None = None
    features: tuple[int, ...] = ()


class Runner(ABC):
    """A target backend: a backend subclasses this, implements the abstract members, and keeps or overrides
    the members with a body (the defaults)."""

    length: int  # positions held in the cache
    prefill_chunk: int = 256  # prompt tokens per prefill pass (the engine's chunked prefill)
    can_features: bool = False  # forward(features=...) returns hidden features

    @abstractmethod
    def reset(self, params=None) -> None:
        """Start an empty sequence. params (SamplingParams): the generation's sampling, for backends whose
        numerics follow it (the fast backend's exact mode); None keeps the last generation's."""

    @abstractmethod
    def forward(self, ids, tree: TreeMask | None = None, *, last_only: bool = False,
                features: tuple[int, ...] = ()) -> Scores:
        """ids [n] appended after the cached positions (causally, or as tree nodes) -> Scores.

        features: hidden-state indices to return (transformers' numbering: i = the output of decoder
        layer i - 1, num_hidden_layers = the final normed state), concatenated per position."""

    @abstractmethod
    def rollback(self, length: int) -> None:
        """Keep the first `length` positions (no-op when it holds fewer)."""

    def commit(self, start: int, keep: list[int]) -> None:
        """Move the entries at slots start + keep[i] to slot start + i; length becomes start + len(keep).
        A contiguous path from start is a crop; a backend overrides this for scattered (tree) paths."""
        if not path_is_chain(keep):
            raise InvalidParameter("this backend cannot commit a tree path; drop the tree option")
        self.rollback(start + len(keep))

    def check_tree_support(self) -> None:
        """Raise (UnsupportedModel, InvalidParameter) now, not mid-generation, when forward cannot take a tree."""
        raise InvalidParameter("this target backend cannot verify trees; drop the tree option")

    def batch_key(self, call: Forward):
        """Runners whose calls have equal keys can score them in one shared forward (`forward_together`);
        None: this call runs alone (the default)."""
        return None

    @staticmethod
    def forward_together(runners: list["Runner"], calls: list[Forward]) -> list[Scores]:
        """Each runner's call scored (the runners' batch_keys are equal), in order; a backend whose calls
        can share forwards overrides this. The default: each runner's own forward, one after another."""
        return [r.forward(c.ids, tree=c.tree, features=c.features) for r, c in zip(runners, calls)]


def path_is_chain(keep) -> bool:
    """Whether `keep` is 0, 1, .., m - 1: a commit that only crops."""
    return all(int(k) == i for i, k in enumerate(keep))
