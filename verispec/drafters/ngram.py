"""Prompt lookup / n-gram drafting: find the latest earlier occurrence of the last n tokens (n from
max_n down to min_n) in prompt + output and propose what followed it. Costs no model call; proposals
are point masses (no draft probabilities)."""

from __future__ import annotations

import numpy as np
import torch

from verispec.errors import InvalidParameter
from verispec.types import Proposal, SamplingParams, StepResult


def find_continuation(context: list[int] | np.ndarray, k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """The up-to-k tokens that followed the latest earlier match of the longest matching suffix."""
    seq = np.asarray(context, dtype=np.int64)
    length = len(seq)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = seq[length - n:]
        # windows starting at i = 0 .. length-n-1 (the suffix itself, at length-n, is excluded)
        windows = np.lib.stride_tricks.sliding_window_view(seq[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return seq[start: start + k].tolist()
    return []


class NGramDrafter:
    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if min_n < 1 or max_n < min_n:
            raise InvalidParameter(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def begin(self, prompt: list[int], params: SamplingParams, generator: torch.Generator | None) -> None:
        pass

    def propose(self, context: list[int], k: int) -> Proposal | None:
        tokens = find_continuation(context, k, self.max_n, self.min_n)
        if not tokens:
            return None
        return Proposal(tokens=torch.tensor(tokens, dtype=torch.long))

    def observe(self, result: StepResult) -> None:
        pass
