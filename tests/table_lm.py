"""A tiny language model given by a table (next-token logits depend on the last two tokens), with the
runner interface the engine uses. Its forward costs microseconds, so distribution tests can afford the
tens of thousands of samples that give them statistical power, and its distributions are known exactly."""

from __future__ import annotations

import itertools

import torch

from verispec.backends import Runner, Scores
from verispec.drafters.base import Drafter
from verispec.sampling import logits_to_probs, sample
from verispec.types import Proposal, SamplingParams, StepResult


class TableLM(Runner):
    def __init__(self, vocab: int = 6, seed: int = 0, scale: float = 2.0):
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.table = torch.randn(vocab, vocab, vocab, generator=g) * scale  # [prev2, prev1] -> logits
        self.tokens: list[int] = []
        self.length = 0

    def next_logits(self, context: list[int]) -> torch.Tensor:
        a = context[-2] if len(context) >= 2 else 0
        b = context[-1]
        return self.table[a, b]

    # runner interface
    def reset(self, params=None) -> None:
        self.tokens, self.length = [], 0

    def forward(self, ids, tree=None, *, last_only: bool = False, features=()):
        ids = [int(i) for i in (ids.tolist() if torch.is_tensor(ids) else ids)]
        out = []
        for t in ids:
            self.tokens.append(t)
            out.append(self.next_logits(self.tokens))
        self.length = len(self.tokens)
        logits = torch.stack(out)
        return Scores(logits[-1:] if last_only else logits)

    def rollback(self, length: int) -> None:
        self.tokens = self.tokens[:length]
        self.length = len(self.tokens)

    def exact_distribution(self, prompt: list[int], params: SamplingParams, n: int = 3) -> dict[tuple, float]:
        """P(first n tokens) under the transformed target distribution, by enumeration."""
        dist = {}
        for seq in itertools.product(range(self.vocab), repeat=n):
            ctx, prob = list(prompt), 1.0
            for t in seq:
                p = logits_to_probs(self.next_logits(ctx), params)
                prob *= float(p[t])
                ctx.append(t)
                if prob == 0.0:
                    break
            if prob > 0:
                dist[seq] = prob
        return dist


class TableDrafter(Drafter):
    """Drafts k tokens by sampling a (different) table model, reporting its draft distribution q."""

    name = "table"

    def __init__(self, model: TableLM, with_probs: bool = True):
        self.model, self.with_probs = model, with_probs

    def begin(self, prompt, params, generator):
        self.params, self.generator = params, generator

    def propose(self, context, k):
        ctx, toks, qs = list(context), [], []
        for _ in range(k):
            q = logits_to_probs(self.model.next_logits(ctx), self.params)
            x = sample(q, self.generator)
            toks.append(x)
            qs.append(q)
            ctx.append(x)
        return Proposal(torch.tensor(toks), torch.stack(qs) if self.with_probs else None)

    def observe(self, result: StepResult):
        pass


class FixedDrafter(Drafter):
    """Point-mass drafts chosen by a rule: deterministic tokens, no probabilities."""

    name = "fixed"

    def __init__(self, rule):
        self.rule = rule

    def begin(self, prompt, params, generator):
        pass

    def propose(self, context, k):
        return Proposal(torch.tensor([self.rule(len(context) + i) for i in range(k)]))

    def observe(self, result):
        pass


class DisjointDrafter(Drafter):
    """Samples from q = uniform over the tokens the target gives probability 0 (after top-k)."""

    name = "disjoint"

    def __init__(self, target: TableLM):
        self.target = target

    def begin(self, prompt, params, generator):
        self.params, self.generator = params, generator

    def propose(self, context, k):
        ctx, toks, qs = list(context), [], []
        for _ in range(k):
            p = logits_to_probs(self.target.next_logits(ctx), self.params)
            q = (p == 0).float()
            q = q / q.sum()
            x = sample(q, self.generator)
            toks.append(x)
            qs.append(q)
            ctx.append(x)
        return Proposal(torch.tensor(toks), torch.stack(qs))

    def observe(self, result):
        pass
