"""Logits to probabilities: temperature, top-k and top-p, shared by target and drafters.

Speculative sampling is lossless for the distribution that both sides agree on, so the draft's q and
the target's p must go through exactly this transform (Leviathan et al. 2023, section 2.3).
"""

from __future__ import annotations

import torch

from verispec.types import SamplingParams


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] in float32.

    Greedy (temperature 0) gives a one-hot at the argmax, so the same acceptance code serves both.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p: a token is dropped when the mass before it
        # already reaches top_p (the first token is always kept)
        before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = before >= params.top_p
        drop_sorted[..., 0] = False  # a top_p below float32's range rounds to 0 and would drop every token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from probs [V]."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
