"""Suffix decoding where it is confident, a trained drafter everywhere else (`--method suffix+eagle`, ...).

Suffix decoding (drafters/suffix.py) costs no model call and is right for long stretches where the answer
repeats its prompt or an earlier answer (retrieval, summaries, code edits, translations that copy names); a
trained drafter (EAGLE, DFlash, Medusa) pays a head forward per draft but also guesses text that occurs
nowhere before. Each step this drafter first asks the suffix tries for their best speculation tree and
offers it as a free proposal (Drafter.propose_free) when its score, the expected number of accepted tokens
under the tries' counts (the SuffixDecoding paper's tree score), is at least `min_score`; otherwise the
trained drafter drafts as it would alone, under the engine's draft length or tree budget. Choosing per step
by a cache draft's expected payoff is the rule of hybrid cache/model drafters in production engines
(Baseten's suffix automaton + MTP in TensorRT-LLM, 2025; Su et al. 2026, "Hybrid Verified Decoding",
arXiv 2606.01019, who learn the payoff estimate instead).

Both drafters see every committed token: the suffix tries index the context (and the cross-request cache
gets each step's tokens), the trained drafter gets the target's features of every committed position,
also those of the steps the suffix tries drafted, so its next proposal starts from the whole context.
Output stays lossless: suffix proposals are point masses, which the acceptance rule verifies exactly.
"""

from __future__ import annotations

import torch

from verispec.drafters.base import Drafter
from verispec.drafters.suffix import SuffixDrafter
from verispec.errors import InvalidParameter
from verispec.types import Proposal, SamplingParams, StepResult

# one expected accepted token: more than the trained heads shipped for the small targets accept per drafted
# step, and the least a verified node must bring to pay for its position
DEFAULT_MIN_SCORE = 1.0


class HybridDrafter(Drafter):
    """A SuffixDrafter's confident speculations (free proposals), else `model`'s drafts."""

    def __init__(self, suffix: SuffixDrafter, model: Drafter, min_score: float = DEFAULT_MIN_SCORE):
        if isinstance(min_score, bool) or not isinstance(min_score, (int, float)) or min_score < 0:
            raise InvalidParameter(f"the hybrid's min_score must be a number >= 0 (expected accepted tokens), got {min_score!r}")
        self.suffix, self.model, self.min_score = suffix, model, float(min_score)
        self.name = f"suffix+{model.name}"
        self.can_tree = model.can_tree
        self.feature_layers = model.feature_layers

    def begin(self, prompt: list[int], params: SamplingParams, generator: torch.Generator | None) -> None:
        self.suffix.begin(prompt, params, generator)
        self.model.begin(prompt, params, generator)

    def propose_free(self, context: list[int], depth: int, nodes: int, tree: bool) -> Proposal | None:
        spec = self.suffix.best(context, nodes, topk=None if tree else 1, max_depth=depth)
        if spec is None or spec.score < self.min_score:
            return None
        return Proposal(tokens=torch.tensor(spec.tokens, dtype=torch.long), parents=list(spec.parents) if tree else None)

    def propose(self, context: list[int], k: int) -> Proposal | None:
        return self.model.propose(context, k)

    def propose_tree(self, context: list[int], shape) -> Proposal | None:
        return self.model.propose_tree(context, shape)

    def check_tree_support(self) -> None:
        self.model.check_tree_support()

    def observe_features(self, features: torch.Tensor) -> None:
        self.model.observe_features(features)

    def observe(self, result: StepResult) -> None:
        self.suffix.observe(result)
        self.model.observe(result)

    def forget(self) -> None:
        """Drop the suffix cache's cross-request memory (as SuffixDrafter.forget), and the model's."""
        self.suffix.forget()
        self.model.forget()
