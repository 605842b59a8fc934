"""An independent draft model: a smaller causal LM with the target's vocabulary, drafting autoregressively.

Its own KV cache is kept in step with the committed tokens: before each proposal the cache is cut
back to the longest prefix it shares with the committed sequence, and only the rest is fed.
"""

from __future__ import annotations

import torch

from verispec.errors import VocabularyMismatch
from verispec.runner import HFRunner
from verispec.sampling import logits_to_probs, sample
from verispec.types import Proposal, SamplingParams, StepResult


def check_same_vocabulary(target_tokenizer, draft_tokenizer, target_name: str, draft_name: str) -> None:
    if target_tokenizer is draft_tokenizer:
        return
    tv, dv = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if tv != dv:
        raise VocabularyMismatch(
            f"draft model '{draft_name}' has another vocabulary than '{target_name}' ({len(dv)} vs {len(tv)} tokens); "
            "use a draft model with the target's tokenizer, or --method ngram"
        )


class DraftModelDrafter:
    name = "draft"

    def __init__(self, model: torch.nn.Module, target_vocab_size: int):
        self.runner = HFRunner(model)
        self.vocab = target_vocab_size
        self.cached: list[int] = []  # the token ids whose KV entries the draft cache holds
        self.params = SamplingParams()
        self.generator: torch.Generator | None = None

    def begin(self, prompt: list[int], params: SamplingParams, generator: torch.Generator | None) -> None:
        self.runner.reset()
        self.cached = []
        self.params, self.generator = params, generator

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        # embedding matrices are often padded past the tokenizer; compare distributions over the target's ids
        if logits.shape[-1] > self.vocab:
            return logits[..., : self.vocab]
        if logits.shape[-1] < self.vocab:
            pad = logits.new_full((*logits.shape[:-1], self.vocab - logits.shape[-1]), float("-inf"))
            return torch.cat([logits, pad], dim=-1)
        return logits

    def sync(self, context: list[int]) -> torch.Tensor:
        """Bring the cache to context[:-1] plus the last token fed; return the logits after context."""
        common = 0
        limit = min(len(self.cached), len(context) - 1)
        while common < limit and self.cached[common] == context[common]:
            common += 1
        self.runner.crop(common)
        self.cached = self.cached[:common]
        feed = context[common:]
        logits = self.runner.forward(feed, last_only=True)[-1]
        self.cached.extend(feed)
        return logits

    def propose(self, context: list[int], k: int) -> Proposal | None:
        logits = self.sync(context)
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for i in range(k):
            q = logits_to_probs(self._fit_vocab(logits), self.params)
            x = int(q.argmax()) if self.params.greedy else sample(q, self.generator)
            tokens.append(x)
            probs.append(q)
            if i < k - 1:
                logits = self.runner.forward([x])[-1]
                self.cached.append(x)
        if not tokens:
            return None
        draft_probs = None if self.params.greedy else torch.stack(probs)
        return Proposal(tokens=torch.tensor(tokens, dtype=torch.long), draft_probs=draft_probs)

    def observe(self, result: StepResult) -> None:
        pass  # the next sync() crops the cache to the committed prefix
