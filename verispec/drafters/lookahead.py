"""Lookahead decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding", ICML): Jacobi iteration over a window, an n-gram pool from its trajectories, and
the verification of pooled n-grams, all in ONE target forward under one tree attention mask.

The window holds N - 1 levels of W tokens (level 0 the oldest). Its attention structure (the paper's
figure 2b, as llama.cpp's lookahead example lays it out) is a tree hung under the pending token:
level 0 is a chain (column i's parent is column i - 1), and the token at level j >= 1, column i has
the token at level j - 1 of the same column as its parent. Every window token therefore sees exactly
one token per position (the pending token, level 0's columns up to its own, then its column's lower
levels), at depth i + j + 1: the same kind of tree the verifier already runs, so exact mode's
layout-free attention (fast/canonical.py) gives each row the bits it would have as a chain. The window
goes to the engine as auxiliary nodes of the proposal (types.Proposal.aux_tokens): they join the
verification forward and are never accepted; their logits come back in StepResult.aux_logits.

Each step, with the target's argmax at the top level's nodes as the new level (Jacobi update):
  * while the window fills (its first N - 2 steps) the new level is appended;
  * then column i yields the n-gram (level 0 .. level N-2 at column i, new token i), stored in the
    pool under its first token (at most G per key, the most recent kept), and the window shifts up.
Candidates: the pool's n-grams that start with the pending token, the most recent G, their remaining
N - 1 tokens merged into a trie. They are point masses, so greedy verification equals plain decoding
and sampling uses the multi-candidate rule of acceptance.py, lossless for any tokens chosen
without the step's random numbers (the window's argmax depends on earlier forwards only).
"""

from __future__ import annotations

import random
from collections import OrderedDict

import torch

from verispec.drafters.base import Drafter
from verispec.types import Proposal, SamplingParams, StepResult


class LookaheadDrafter(Drafter):
    name = "lookahead"

    def __init__(self, window: int = 2, ngram: int = 3, candidates: int = 2, seed: int = 0):
        """window W (tokens per level), ngram N (n-gram size; N - 1 levels), candidates G (n-grams verified
        per step, and kept per first token in the pool). The defaults are the fastest of the settings
        measured on a 2-core CPU (docs/lookahead.md): each window token is a row of every forward, and
        rows are not free there."""
        self.W, self.N, self.G, self.seed = window, ngram, candidates, seed
        self.pool: dict[int, OrderedDict] = {}
        self.levels: list[list[int]] = []
        self._top: list[int] = []  # auxiliary-node indices of the top level's columns, for observe()

    def begin(self, prompt: list[int], params: SamplingParams, generator: torch.Generator | None) -> None:
        # the first level is a guess: tokens of the prompt (the paper starts from random tokens; prompt
        # tokens are as good a guess and keep the ids in range), chosen by a fixed seed so runs repeat
        rng = random.Random(self.seed)
        self.levels = [[rng.choice(prompt) for _ in range(self.W)]]
        self.pool = {}
        self._top = []

    def candidates(self, key: int, k: int) -> tuple[list[int], list[int]]:
        """The pooled n-grams after `key`, cut to k tokens, merged into a trie -> (tokens, parents)."""
        tokens, parents, node = [], [], {}
        for gram in reversed(self.pool.get(key, {})):  # most recent first
            parent, path = -1, ()
            for t in gram[:k]:
                path += (t,)
                if path not in node:
                    node[path] = len(tokens)
                    tokens.append(t)
                    parents.append(parent)
                parent = node[path]
        return tokens, parents

    def propose(self, context: list[int], k: int) -> Proposal | None:
        tokens, parents = self.candidates(context[-1], k)
        n = len(tokens)
        aux, aux_parents, where = [], [], {}
        for j, level in enumerate(self.levels):
            for i, t in enumerate(level):
                if j == 0:
                    parent = -1 if i == 0 else n + where[0, i - 1]
                else:
                    parent = n + where[j - 1, i]
                where[j, i] = len(aux)
                aux.append(t)
                aux_parents.append(parent)
        self._top = [where[len(self.levels) - 1, i] for i in range(self.W)]
        return Proposal(tokens=torch.tensor(tokens, dtype=torch.long), parents=parents,
                        aux_tokens=torch.tensor(aux, dtype=torch.long), aux_parents=aux_parents)

    def observe(self, result: StepResult) -> None:
        if result.aux_logits is None:
            return
        new = result.aux_logits[self._top].argmax(-1).tolist()
        if len(self.levels) < self.N - 1:
            self.levels.append(new)
            return
        for i in range(self.W):
            gram = tuple(level[i] for level in self.levels[1:]) + (new[i],)
            grams = self.pool.setdefault(self.levels[0][i], OrderedDict())
            grams.pop(gram, None)
            grams[gram] = None  # the most recent last
            while len(grams) > self.G:
                grams.popitem(last=False)
        self.levels = self.levels[1:] + [new]
