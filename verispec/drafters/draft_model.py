"""An independent draft model: a smaller causal LM with the target's vocabulary, drafting autoregressively
(a draft model with another vocabulary is wrapped by cross_vocab.py).

Its own KV cache is kept in step with the committed tokens: before each proposal the cache is cut
back to the longest prefix it shares with the committed sequence, and only the rest is fed.

Trees: the draft model grows the tree depth by depth, feeding each depth's nodes to be expanded in ONE
forward under a tree mask (Runner.forward with a TreeMask start), and branches into its top-k tokens:
  * static shapes (tree.StaticTree): each node's children are its top-k tokens as point masses when
    greedy; when sampling, they are drawn from q without replacement (row i = q with the earlier
    siblings removed), which keeps the verification exact because the shape does not depend on them;
  * dynamic shapes (tree.DynamicTree, EAGLE-2): top-k tokens as point masses, ranked by cumulative draft
    probability (pruning by value would bias sampled candidates; point masses are exact under any choice).
After verification, observe() compacts the accepted path's entries in the draft cache into contiguous
slots, so the next proposal only feeds the new tokens.
"""

from __future__ import annotations

import torch

from verispec.backends import TreeMask
from verispec.backends.transformers import HFRunner
from verispec.sampling import logits_to_probs, sample
from verispec.tree import Candidate, DynamicTree, StaticTree, select_best, to_proposal
from verispec.drafters.base import Drafter
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

    def _children(self, logits: torch.Tensor, parent: int, parent_score: float, depth: int, m: int,
                  sampled: bool) -> list[Candidate]:
        logits = self._fit_vocab(logits)
        if sampled:
            q = logits_to_probs(logits, self.params)
            left, out = q.clone(), []
            for _ in range(m):
                total = left.sum()
                if total <= 0:
                    break
                qi = left / total
                x = sample(qi, self.generator)
                out.append(Candidate(x, parent, parent_score * float(q[x]), qi, depth))
                left[x] = 0
            return out
        # greedy verification ignores q, but ranking needs real probabilities, not the greedy one-hot
        probs = logits.float().softmax(-1) if self.params.greedy else logits_to_probs(logits, self.params)
        vals, idx = probs.topk(min(m, probs.shape[-1]))
        return [Candidate(int(t), parent, parent_score * float(v), None, depth)
                for v, t in zip(vals.tolist(), idx.tolist()) if v > 0]

    def _feed(self, cands: list[Candidate], nodes: list[int]) -> torch.Tensor:
        """Run the draft model on tree nodes whose ancestors were fed before -> their logits [b, V]."""
        t = self._tree
        first, b = len(t["fed_depths"]), len(nodes)
        mask = torch.zeros(b, first + b, dtype=torch.bool)
        for r, c in enumerate(nodes):
            mask[r, first + r] = True
            p = cands[c].parent
            while p >= 0:
                mask[r, t["slot"][p]] = True
                p = cands[p].parent
        depths = t["fed_depths"] + [cands[c].depth - 1 for c in nodes]
        logits = self.runner.forward([cands[c].token for c in nodes],
                                     tree=TreeMask(mask, torch.tensor(depths), t["start"])).logits
        for r, c in enumerate(nodes):
            t["slot"][c] = first + r
        t["fed_depths"] = depths
        return logits

    def propose_tree(self, context: list[int], shape) -> Proposal | None:
        root = self.sync(context)
        self._tree = {"start": self.runner.length, "slot": {}, "fed_depths": [], "keep": []}
        cands: list[Candidate] = []
        if isinstance(shape, StaticTree):
            need = shape.children_ranks()
            sampled = not self.params.greedy
            where: dict[tuple, int] = {(): -1}
            level, logits_of = [()], {(): root}
            for depth in range(1, shape.depth + 1):
                new_paths = []
                for path in level:
                    if need.get(path, 0) == 0:
                        continue
                    parent = where[path]
                    score = cands[parent].score if parent >= 0 else 1.0
                    for r, cand in enumerate(self._children(logits_of[path], parent, score, depth, need[path], sampled)):
                        where[path + (r,)] = len(cands)
                        cands.append(cand)
                        new_paths.append(path + (r,))
                expand = [p for p in new_paths if need.get(p, 0) > 0]
                if expand:
                    logits_of.update(zip(expand, self._feed(cands, [where[p] for p in expand])))
                level = new_paths
            keep = sorted(where[p] for p in shape.paths if p in where)
        elif isinstance(shape, DynamicTree):
            cands = self._children(root, -1, 1.0, 1, shape.topk, sampled=False)
            frontier = list(range(len(cands)))
            for depth in range(2, shape.depth + 1):
                expand = sorted(frontier, key=lambda c: -cands[c].score)[: shape.topk]
                if not expand:
                    break
                frontier = []
                for row, c in zip(self._feed(cands, expand), expand):
                    for cand in self._children(row, c, cands[c].score, depth, shape.topk, sampled=False):
                        frontier.append(len(cands))
                        cands.append(cand)
            keep = select_best(cands, shape.budget or 16)
        else:
            raise TypeError(f"unknown tree shape {shape!r}")
        if not keep:
            return None
        self._tree["keep"] = keep
        self._tree["tokens"] = [cands[c].token for c in keep]
        return to_proposal(cands, keep, vocab=self.vocab)

    def observe(self, result: StepResult) -> None:
        t, self._tree = self._tree, None
        if t is None or not t["keep"]:
            # chains: drop the rejected drafts' entries now, so the cache holds committed tokens only
            base = getattr(self, "_chain_base", None)
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
