"""Lossless acceptance rules for a drafted chain, as pure functions of tensors.

Trees have their own rules in tree_acceptance.py. Every rule returns a StepResult: the accepted draft
tokens plus exactly one token drawn from the target (recovered after a rejection, bonus after a full
accept), which is why a step always makes progress.
"""

from __future__ import annotations

import torch

from verispec.sampling import sample
from verispec.types import StepResult


def greedy_verify(draft: torch.Tensor, target_logits: torch.Tensor) -> StepResult:
    """Accept the longest prefix of `draft` equal to the target's argmax, then the target's own token.

    draft:         LongTensor [k]
    target_logits: Tensor [k+1, V]  logits[i] is the target's prediction after draft[:i]
    """
    k = int(draft.numel())
    choice = target_logits.argmax(-1)  # [k+1]
    mismatch = (choice[:k] != draft.to(choice.device)).nonzero()
    n = int(mismatch[0, 0]) if mismatch.numel() else k
    tokens = [int(t) for t in draft[:n].tolist()] + [int(choice[n])]
    return StepResult(tokens=tokens, num_accepted=n, num_drafted=k, accepted_nodes=list(range(n)))


def speculative_verify(draft: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                       generator: torch.Generator | None) -> StepResult:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023).

    draft:        LongTensor [k]
    draft_probs:  Tensor [k, V] q_i, the distribution draft[i] was sampled from; None = point masses
    target_probs: Tensor [k+1, V] p_i after the same temperature/top-k/top-p transform as q_i

    Accept draft[i] with probability min(1, p_i(x)/q_i(x)); at the first rejection sample from
    normalize(max(0, p_i - q_i)); when all k are accepted sample a bonus token from p_k.
    """
    k = int(draft.numel())
    device = target_probs.device
    draft = draft.to(device)
    idx = torch.arange(k, device=device)
    p_x = target_probs[idx, draft]
    q_x = draft_probs.to(device)[idx, draft].float() if draft_probs is not None else torch.ones(k, device=device)
    u = torch.rand(k, generator=generator, device=generator.device if generator is not None else "cpu").to(device)
    accepted = u * q_x < p_x  # u < p/q without dividing; q_x > 0 for any token the drafter proposed
    rejected = (~accepted).nonzero()
    n = int(rejected[0, 0]) if rejected.numel() else k
    if n == k:
        last = sample(target_probs[k], generator)
    else:
        q_n = draft_probs[n].to(device).float() if draft_probs is not None else torch.nn.functional.one_hot(draft[n], target_probs.shape[-1]).float()
        residual = (target_probs[n] - q_n).clamp_min(0)
        total = residual.sum()
        # a rejection implies p_n(x) < q_n(x), hence residual mass > 0; guard against float round-off only
        last = sample(residual / total if total > 0 else target_probs[n], generator)
    tokens = [int(t) for t in draft[:n].tolist()] + [last]
    return StepResult(tokens=tokens, num_accepted=n, num_drafted=k, accepted_nodes=list(range(n)))
