"""A draft model with another tokenizer: drafts in its own vocabulary, proposes through the text.

String-level exact match (SLEM; Timor et al. 2025, "Accelerating LLM Inference with Lossless
Speculative Decoding Algorithms for Heterogeneous Vocabularies", ICML, section 3.1). Each step:

    text   = target.decode(context)                the committed text
    ids    = draft.encode(text)                    the same text in the draft's tokens
    extra  = draft model continues ids by k tokens (greedy: argmax; sampling: drawn from its q)
    tokens = target.encode(draft.decode(extra))    the drafted text in the target's tokens, cut to k

The tokens go to the target as point masses (Proposal.draft_probs None). The engine's rules then
accept a drafted token x with probability p(x) and fall back to p with x removed, which is the same
law as the paper's "the target samples its token and the draft is kept while they match": greedy, it
is the longest prefix equal to the target's argmax; sampling, it is lossless for any tokens chosen
without looking at the target's random numbers (acceptance.py), so the draft's
q, which lives over another vocabulary, is never needed. What re-tokenizing gets wrong (a draft that
ends inside a word, text the target splits otherwise) only costs acceptance, never exactness.

The draft model's KV cache follows the draft-side ids of the committed text by longest common prefix
(DraftModelDrafter.sync), so each step feeds only the tokens whose text changed; text decoding and
encoding of the whole context each step costs a few milliseconds at most at a few thousand tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from verispec.drafters.base import Drafter
from verispec.types import Proposal, SamplingParams, StepResult


@dataclass(frozen=True)
class TextCodec:
    """A vocabulary's way between ids and text (no special tokens added or shown)."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]

    @classmethod
    def of(cls, tokenizer) -> "TextCodec":
        """A transformers tokenizer's codec."""
        return cls(encode=lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"]),
                   decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))


class CrossVocabularyDrafter(Drafter):
    name = "cross-vocabulary draft"

    def __init__(self, inner, target: TextCodec, draft: TextCodec, max_context: int | None = None):
        """inner: a DraftModelDrafter over the draft model's own vocabulary (its proposals are draft ids);
        max_context: the most draft tokens it may hold (the same text can take more draft than target
        tokens; past that, steps decode plainly)."""
        self.inner, self.target, self.draft = inner, target, draft
        self.max_context = max_context

    def begin(self, prompt: list[int], params: SamplingParams, generator: torch.Generator | None) -> None:
        self.inner.begin(self.draft.encode(self.target.decode(prompt)), params, generator)

    def propose(self, context: list[int], k: int) -> Proposal | None:
        ids = self.draft.encode(self.target.decode(context))
        if not ids or (self.max_context is not None and len(ids) + k > self.max_context):
            return None  # no text yet (special tokens only), or more than the draft model holds: decode plainly
        drafted = self.inner.propose(ids, k)
        if drafted is None:
            return None
        before = self.draft.decode(ids)
        after = self.draft.decode(ids + drafted.tokens.tolist())
        # decoding is not always additive (a byte split across tokens, cleanup of spaces); then the
        # drafted tokens alone are the best guess at the new text
        text = after[len(before):] if after.startswith(before) else self.draft.decode(drafted.tokens.tolist())
        tokens = self.target.encode(text.rstrip("\ufffd"))[:k]  # an incomplete UTF-8 character drafts nothing
        if not tokens:
            return None
        return Proposal(tokens=torch.tensor(tokens, dtype=torch.long))

    def observe(self, result: StepResult) -> None:
        # nothing to learn: the next proposal re-syncs the draft cache from the committed text
        pass
