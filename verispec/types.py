"""Plain data passed around the loop: sampling parameters, a drafter's proposal, a step's verdict."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Literal

from verispec.errors import InvalidParameter


MIN_TEMPERATURE = 1e-5
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """How the target's distribution is shaped; the same transform is applied to the draft's.

    temperature 0 means greedy, and so does any temperature below MIN_TEMPERATURE (as in vLLM): dividing
    logits by a smaller one overflows to inf/nan, and the distribution it stands for is the argmax
    anyway. top_k 0 and top_p 1.0 mean "off"; a tiny top_p keeps the most likely token. seed: an
    integer in [SEED_MIN, SEED_MAX] (what torch.Generator takes), or None for a random one.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, numbers.Real) \
                or not (0.0 <= self.temperature < math.inf):
            raise InvalidParameter(f"temperature must be >= 0 and finite (0 = greedy), got {self.temperature}")
        if self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidParameter(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidParameter(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidParameter(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidParameter(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if any(not s for s in self.stop):
            raise InvalidParameter("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Proposal:
    """What a drafter proposes for one step.

    tokens:      LongTensor [n]     drafted token ids (a chain, or the nodes of a tree in topological order)
    draft_probs: FloatTensor [n, V] the draft distribution each token was drawn from (after the same
                 sampling transform as the target), or None: the tokens count as point masses
    parents:     list[int] | None   tree parent of each node (-1 = the pending root token); None = chain
    aux_tokens:  LongTensor [m] | None  auxiliary nodes: run in the same forward under the same tree mask,
                 never accepted; the target's logits there come back in StepResult.aux_logits (lookahead
                 decoding's Jacobi window, drafters/lookahead.py)
    aux_parents: list[int] | None   their parents over all nodes: -1 = root, 0..n-1 = drafted node,
                 n..n+m-1 = an earlier auxiliary node (topological order)
    free:        bool   drafted without a model call, before the step's budget was asked
                 (Drafter.propose_free): its verdict does not teach the auto budget, which prices the
                 drafter's own proposals
    """

    tokens: "torch.Tensor"  # noqa: F821
    draft_probs: "torch.Tensor | None" = None
    parents: list[int] | None = None
    aux_tokens: "torch.Tensor | None" = None
    aux_parents: list[int] | None = None
    free: bool = False

    def __len__(self) -> int:
        return int(self.tokens.numel())


TokenKind = Literal["prompt", "accepted", "recovered", "bonus"]


@dataclass
class StepResult:
    """The verdict of one verification step.

    tokens:       the tokens this step commits: accepted draft tokens, then one recovered token (after a
                  rejection) or one bonus token (all drafts accepted, or nothing drafted)
    num_accepted: how many draft tokens were accepted
    num_drafted:  how many were proposed (tree: nodes)
    accepted_nodes: proposal indices of the accepted nodes (chain: 0..num_accepted-1)
    bonus:        whether the last token is a bonus (the walk ended at a leaf, no rejection) rather than
                  recovered; None = decide from the counts (a chain)
    aux_logits:   the target's logits [m, V] at the proposal's auxiliary nodes (None: it had none)
    """

    tokens: list[int]
    num_accepted: int
    num_drafted: int
    accepted_nodes: list[int] = field(default_factory=list)
    bonus: bool | None = None
    aux_logits: "torch.Tensor | None" = None

    @property
    def last_kind(self) -> TokenKind:
        if self.bonus is not None:
            return "bonus" if self.bonus else "recovered"
        return "bonus" if self.num_accepted == self.num_drafted else "recovered"

    def kinds(self) -> list[TokenKind]:
        return ["accepted"] * self.num_accepted + [self.last_kind]
