"""Lossless acceptance rules for a draft tree (a chain is the tree whose parents are the previous node),
as pure functions of tensors; `verify` picks the rule.

Every rule returns a StepResult: the accepted draft tokens plus exactly one token drawn from the target
(recovered after a rejection, bonus after a full accept), which is why a step always makes progress.
Node 0 is the pending root (the last committed token); drafted node i is node i + 1. The rules walk
down from the root and return accepted_nodes as proposal indices. A plain chain (parents None) takes
the vectorised chain rules below, the tree rules' special case written with whole-tensor comparisons.

Greedy (`greedy_tree_verify`): follow the child whose token equals the target's argmax, as deep as it
goes, then emit the target's own argmax there. Equal to plain greedy decoding token for token.

Sampling (`tree_speculative_verify`), multi-candidate speculative sampling (SpecInfer, Miao et al.
2024, section 4.3; recursive rejection sampling, Jeon et al. 2024). At each node, with p the target's
distribution there, take the children in proposal order; child i carries q_i, the distribution its
token x_i was drawn from given everything drafted before it:

    accept x_i with probability min(1, p(x_i) / q_i(x_i)), and descend into it;
    on rejection  p <- normalize(max(0, p - q_i)) and try the next child;
    no child accepted: sample the step's last token from the current p (the residual).

One induction step of the chain proof (Leviathan et al. 2023) shows that "accept or fall back to the
residual" reproduces p exactly; falling back to "the same procedure on the residual" does too. So the
output is distributed exactly as the target whenever each x_i is, given the history, a draw from q_i
that does not depend on the target's random numbers. Which proposals that covers:

  * point-mass candidates (draft_probs None, or one-hot rows): any deterministic choice of tokens,
    e.g. the draft's top-k or n-gram continuations. q_i = delta(x_i): accept with probability p(x_i);
    on rejection p loses x_i and is renormalised;
  * candidates sampled independently from the same q (SpecInfer): each row is q itself;
  * candidates sampled without replacement from q: row i is q with the earlier siblings removed and
    renormalised;
  * any mix of these, at any depth.

What it does NOT cover: trees pruned by the values of sampled tokens (e.g. EAGLE-2's reranking applied
to sampled children), since the kept children are then no longer draws from their q_i. Our drafters
use point masses for dynamic trees for that reason.
"""

from __future__ import annotations

import torch

from verispec.sampling import logits_to_probs, sample
from verispec.tree import children_lists
from verispec.types import SamplingParams, StepResult


def verify(tokens: torch.Tensor, parents: list[int] | None, draft_probs: torch.Tensor | None,
           target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> StepResult:
    """The step's rule: tokens [n] drafted nodes, parents [n] (-1 = root; None = a plain chain, which
    takes the vectorised chain rules), draft_probs [n, V] or None, target_logits [n + 1, V] (row 0 at
    the root), params: greedy -> argmax walk, else speculative sampling after params' transform."""
    if params.greedy:
        if parents is None:
            return greedy_verify(tokens, target_logits)
        return greedy_tree_verify(tokens, parents, target_logits)
    probs = logits_to_probs(target_logits, params)
    if parents is None:
        return speculative_verify(tokens, draft_probs, probs, generator)
    return tree_speculative_verify(tokens, parents, draft_probs, probs, generator)


def _full_parents(parents: list[int] | None, n: int) -> list[int]:
    if parents is None:
        parents = list(range(-1, n - 1))
    return [-1] + [int(p) + 1 for p in parents]


def greedy_tree_verify(tokens: torch.Tensor, parents: list[int] | None, target_logits: torch.Tensor) -> StepResult:
    """tokens [n] drafted nodes; parents [n] (-1 = root, None = chain); target_logits [n + 1, V] with row
    0 at the root and row i + 1 at drafted node i."""
    n = int(tokens.numel())
    kids = children_lists(_full_parents(parents, n))
    choice = target_logits.argmax(-1).tolist()
    toks = tokens.tolist()
    node, accepted = 0, []
    while True:
        nxt = next((c for c in kids[node] if toks[c - 1] == choice[node]), None)
        if nxt is None:
            break
        accepted.append(nxt - 1)
        node = nxt
    out = [toks[i] for i in accepted] + [int(choice[node])]
    return StepResult(tokens=out, num_accepted=len(accepted), num_drafted=n, accepted_nodes=accepted,
                      bonus=not kids[node])


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)); a rejection implies positive mass is left, up to float round-off."""
    r = (p - q).clamp_min(0)
    total = r.sum()
    return r / total if total > 0 else p


def tree_speculative_verify(tokens: torch.Tensor, parents: list[int] | None, draft_probs: torch.Tensor | None,
                            target_probs: torch.Tensor, generator: torch.Generator | None) -> StepResult:
    """tokens [n]; parents [n] (-1 = root, None = chain); draft_probs [n, V] (row i = q of node i) or
    None (all point masses); target_probs [n + 1, V] after the sampling transform (row 0 = root)."""
    n = int(tokens.numel())
    kids = children_lists(_full_parents(parents, n))
    toks = tokens.tolist()
    gen_device = generator.device if generator is not None else "cpu"
    u = torch.rand(n, generator=generator, device=gen_device).tolist()  # one uniform per node, drawn up front
    node, accepted = 0, []
    while True:
        p = target_probs[node].float()
        nxt = None
        for c in kids[node]:
            x = toks[c - 1]
            if draft_probs is None:
                q = torch.zeros_like(p)
                q[x] = 1.0
                q_x = 1.0
            else:
                q = draft_probs[c - 1].to(p.device).float()
                q_x = float(q[x])
            if u[c - 1] * q_x < float(p[x]):  # u < p/q without dividing
                nxt = c
                break
            p = _residual(p, q)
        if nxt is None:
            last = sample(p, generator)
            break
        accepted.append(nxt - 1)
        node = nxt
    out = [toks[i] for i in accepted] + [last]
    return StepResult(tokens=out, num_accepted=len(accepted), num_drafted=n, accepted_nodes=accepted,
                      bonus=not kids[node])


# ---- the chain fast case (parents None)

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
        last = sample(_residual(target_probs[n], q_n), generator)
    tokens = [int(t) for t in draft[:n].tolist()] + [last]
    return StepResult(tokens=tokens, num_accepted=n, num_drafted=k, accepted_nodes=list(range(n)))
