"""The drafter contract: propose tokens (with draft probabilities or none), then learn from the verdict."""

from __future__ import annotations

from typing import Protocol

import torch

from verispec.types import Proposal, SamplingParams, StepResult


class Drafter(Protocol):
    """What the engine calls. A drafter subclasses this explicitly, so the capabilities it does not
    declare keep the defaults below (no trees, no target features, no memory across generations); no
    caller probes."""

    name: str
    can_tree: bool = False  # propose_tree works (the engine asks for trees only when a tree shape is set)
    feature_layers: tuple[int, ...] = ()  # the target's hidden-state indices it reads; () = none

    def begin(self, prompt: list[int], params: SamplingParams, generator: torch.Generator | None) -> None:
        """Start a new generation (reset any per-sequence state)."""

    def propose(self, context: list[int], k: int) -> Proposal | None:
        """Propose up to k tokens to follow `context` (prompt + committed output; its last token is not
        yet in the target's cache). None or an empty proposal means: decode one token plainly."""

    def observe(self, result: StepResult) -> None:
        """Learn from what the target accepted (adapt tables, lengths, ...)."""

    def propose_free(self, context: list[int], depth: int, nodes: int, tree: bool) -> Proposal | None:
        """A proposal that costs no model call, asked for before the draft length or the tree budget: at
        most `nodes` nodes, `depth` deep, a tree where `tree` (else a chain: parents None). None (the
        default): draft as usual this step. The engine verifies it like any proposal (Proposal.free)."""
        return None

    def propose_tree(self, context: list[int], shape) -> Proposal | None:
        """(can_tree) Fill `shape` (tree.StaticTree or tree.DynamicTree, already cut to the room left) with
        tokens to follow `context`: a Proposal with parents (topological order, -1 = the pending root) and
        the distribution each node was drawn from (None / one-hot rows = point masses; see acceptance.py
        for what keeps the rule exact)."""
        raise NotImplementedError(f"the '{self.name}' drafter cannot make trees")

    def check_tree_support(self) -> None:
        """(can_tree) Raise now, not mid-generation, when this drafter's trees cannot run here."""

    def observe_features(self, features: torch.Tensor) -> None:
        """(feature_layers) The target's features [n, len(feature_layers) * hidden] at the n positions just
        committed to its cache, in order: the prompt's but the last, then each step's pending token and
        accepted path."""

    def forget(self) -> None:
        """Drop what it keeps across generations (suffix decoding's cache of earlier outputs), so that a
        benchmark's warm-up answer is not drafted from; the default keeps nothing across generations."""


class DraftLengthSchedule:
    """Fixed draft length, or the simple adaptive schedule: +2 after a full accept, -1 after a rejection
    (the heuristic transformers uses for assisted generation), kept within [1, maximum]."""

    def __init__(self, length: int, adaptive: bool = False, maximum: int = 16):
        self.length = length
        self.adaptive = adaptive
        self.maximum = max(maximum, length)

    def observe(self, result: StepResult) -> None:
        if not self.adaptive or result.num_drafted == 0:
            return
        if result.num_accepted == result.num_drafted:
            self.length = min(self.maximum, self.length + 2)
        else:
            self.length = max(1, self.length - 1)
