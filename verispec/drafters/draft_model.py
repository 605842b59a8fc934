"""An independent draft model: a smaller causal LM with the target's vocabulary, drafting autoregressively
(a draft model with another vocabulary is wrapped by cross_vocab.py).

Its own KV cache is kept in step with the committed tokens: before each proposal the cache is cut
back to the longest prefix it shares with the committed sequence, and only the rest is fed.

Trees: the draft model is a tree.build Scorer: the one tree builder picks the nodes and children (top-k
point masses, or draws without replacement for sampled static trees), and the draft model feeds each
depth's nodes to be expanded in ONE forward under a tree mask (Runner.forward with a TreeMask start).
After verification, observe() compacts the accepted path's entries in the draft cache into contiguous
slots, so the next proposal only feeds the new tokens.
"""

from __future__ import annotations

import torch

from verispec.backends import TreeMask
from verispec.backends.transformers import HFRunner
from verispec.drafters.base import Drafter
from verispec.sampling import logits_to_probs, sample
from verispec.tree import Candidate, ancestors, build_tree, to_proposal
from verispec.types import Proposal, SamplingParams, StepResult


def same_vocabulary(target_tokenizer, draft_tokenizer) -> bool:
    """Whether token ids mean the same strings for both (else the draft goes through cross_vocab.py)."""
    return target_tokenizer is draft_tokenizer or target_tokenizer.get_vocab() == draft_tokenizer.get_vocab()


class DraftModelDrafter(Drafter):
    name = "draft"
    can_tree = True

    def __init__(self, model: torch.nn.Module, target_vocab_size: int, runner=None):
        self.runner = runner if runner is not None else HFRunner(model)  # runner: e.g. a backends.fast.FastRunner
        self.vocab = target_vocab_size
        self.cached: list[int] = []  # the token ids whose KV entries the draft cache holds
        self.params = SamplingParams()
        self.generator: torch.Generator | None = None
        self._tree = None  # the last proposed tree, until observe() compacts the cache
        self._chain_base: int | None = None  # the committed context of the last proposed chain, until observe()

    def begin(self, prompt: list[int], params: SamplingParams, generator: torch.Generator | None) -> None:
        self.runner.reset()
        self.cached = []
        self._tree = None
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
        self.runner.rollback(common)
        self.cached = self.cached[:common]
        feed = context[common:]
        logits = self.runner.forward(feed, last_only=True).logits[-1]
        self.cached.extend(feed)
        return logits

    def propose(self, context: list[int], k: int) -> Proposal | None:
        logits = self.sync(context)
        self._chain_base = len(self.cached)  # the committed context; drafts fed after it are provisional
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for i in range(k):
            q = logits_to_probs(self._fit_vocab(logits), self.params)
            x = int(q.argmax()) if self.params.greedy else sample(q, self.generator)
            tokens.append(x)
            probs.append(q)
            if i < k - 1:
                logits = self.runner.forward([x]).logits[-1]
                self.cached.append(x)
        if not tokens:
            return None
        draft_probs = None if self.params.greedy else torch.stack(probs)
        return Proposal(tokens=torch.tensor(tokens, dtype=torch.long), draft_probs=draft_probs)

    # ---- trees

    def check_tree_support(self) -> None:
        self.runner.check_tree_support()

    # the tree builder's Scorer (tree.build): the draft model scores children from its own logits
    d2t = None

    def q_of(self, logits: torch.Tensor) -> torch.Tensor:
        return logits_to_probs(logits, self.params)

    def ranking(self, logits: torch.Tensor) -> torch.Tensor:
        # greedy verification ignores q, but ranking needs real probabilities, not the greedy one-hot
        return logits.float().softmax(-1) if self.params.greedy else logits_to_probs(logits, self.params)

    def child_logits(self, cands: list[Candidate], nodes: list[int]) -> torch.Tensor:
        return self._fit_vocab(torch.stack([self._tree["logits"][c] for c in nodes]))

    def feed(self, cands: list[Candidate], nodes: list[int]) -> None:
        """Run the draft model on tree nodes of one depth, in one forward under a tree mask."""
        t = self._tree
        first, b = len(t["fed_depths"]), len(nodes)
        mask = torch.zeros(b, first + b, dtype=torch.bool)
        for r, c in enumerate(nodes):
            mask[r, first + r] = True
            mask[r, [t["slot"][a] for a in ancestors(cands, c)]] = True
        depths = t["fed_depths"] + [cands[c].depth - 1 for c in nodes]
        logits = self.runner.forward([cands[c].token for c in nodes],
                                     tree=TreeMask(mask, torch.tensor(depths), t["start"])).logits
        for r, c in enumerate(nodes):
            t["slot"][c], t["logits"][c] = first + r, logits[r]
        t["fed_depths"] = depths

    def propose_tree(self, context: list[int], shape) -> Proposal | None:
        root = self.sync(context)
        self._tree = {"start": self.runner.length, "slot": {}, "fed_depths": [], "keep": [], "logits": {-1: root}}
        cands, keep = build_tree(self, shape, not self.params.greedy, self.generator)
        if not keep:
            return None
        self._tree["keep"] = keep
        self._tree["tokens"] = [cands[c].token for c in keep]
        return to_proposal(cands, keep, vocab=self.vocab)

    def observe(self, result: StepResult) -> None:
        t, self._tree = self._tree, None
        if t is None or not t["keep"]:
            # chains: drop the rejected drafts' entries now, so the cache holds committed tokens only
            base = self._chain_base
            if base is not None and len(self.cached) > base:
                keep = base + result.num_accepted
                self.runner.rollback(min(keep, self.runner.length))
                self.cached = self.cached[: self.runner.length]
            self._chain_base = None
            return
        # move the accepted path's entries (those the draft model computed) next to the committed prefix
        slots, tokens = [], []
        for i in result.accepted_nodes:
            c = t["keep"][i]
            if c not in t["slot"]:
                break
            slots.append(t["slot"][c])
            tokens.append(t["tokens"][i])
        self.runner.commit(t["start"], slots)
        self.cached = self.cached[: t["start"]] + tokens
