"""Attention whose result for a query row does not depend on which cache slots its keys occupy.

Why. Greedy tree verification is bit-identical to plain decoding only if a tree node's logits are the
bits plain decoding computes for the same token at the same position. A tree node sees its ancestors
at tree slots, not at the contiguous slots plain decoding put them in, and PyTorch's CPU kernels sum
the products probabilities x values in an order that depends on where the nonzero terms sit among the
masked zeros (moving one visible key by 16 slots changed the last bits in a few of 50 trials, in flash
attention and in a plain matmul alike: docs/performance-notes.md). The scores and the
softmax do not have that problem once they are laid out in the same order.

How. Each row's keys are put in canonical order: column c holds the key at position c (the prefix is
already there; a tree row's ancestors are gathered from their slots). Scores are computed over the
slots (each is one dot product, position independent), gathered into canonical order, masked by
position and soft-maxed. The value sum is cut at B = 64 * floor(p / 64) - 64 for a row at position p:
columns below B are prefix (untouched by any tree at most 64 deep), summed by one [rows, B] x [B, D]
product with a fixed row count; columns from B on (at most 127 of them) are gathered into a
[W = 128, D] block per row and summed by a per-row product. Plain decoding goes through the same
computation, so the same position gets the same bits whichever way its keys were laid out.

Cost: a few small kernels per layer instead of one fused attention call (see benchmarks/fast_decode.py
for exact mode's figure), used only in exact mode's eager passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TAIL = 128  # canonical columns summed per row (the cut B leaves at most 127 of them visible)
CUT = 64    # B is a multiple of this; a tree deeper than 64 still verifies right, maybe not bit-identically


@dataclass
class Canon:
    """Per-pass plan, built by the runner once and shared by all layers.

    order:      [T, L] long or None   canonical column -> cache slot (None: identity, a chain pass)
    groups:     list of (B, rows)     the distinct cuts; rows: BoolTensor [T] of the rows with that cut
    tail_cols:  [T, TAIL] long        canonical columns B_r .. B_r + TAIL - 1 (clamped to L - 1)
    tail_slots: [T * TAIL] long       the cache slots of those columns
    tail_past:  [T, TAIL] bool or None  the columns past L - 1 (clamped: they must add zero, not column
                L - 1 again, which a row at position L - 1 sees); None when no column is
    """

    order: torch.Tensor | None
    groups: list[tuple[int, torch.Tensor]]
    tail_cols: torch.Tensor
    tail_slots: torch.Tensor
    tail_past: torch.Tensor | None = None
    _derived: dict = field(default_factory=dict)

    def expanded(self, g: int) -> tuple:
        """The index tensors repeated for g query heads per kv head (built once per pass)."""
        if g not in self._derived:
            self._derived[g] = (None if self.order is None else self.order.repeat(g, 1),
                                  self.tail_cols.repeat(g, 1),
                                  [(b, rows.repeat(g)[:, None]) for b, rows in self.groups],
                                  None if self.tail_past is None else self.tail_past.repeat(g, 1))
        return self._derived[g]

    def flat_slots(self, kvh: int, S: int) -> torch.Tensor:
        """tail_slots as rows of a [kvh * S, D] view of the cache."""
        key = ("flat", kvh, S)
        if key not in self._derived:
            heads = torch.arange(kvh, device=self.tail_slots.device)[:, None] * S
            self._derived[key] = (heads + self.tail_slots[None, :]).reshape(-1)
        return self._derived[key]


def plan(positions: torch.Tensor, L: int, order: torch.Tensor | None, floor: int | None = None) -> Canon:
    """positions [T] of the pass's rows; order as in Canon; floor: cuts may not pass this column (the
    first tree slot: columns below it are prefix in slot order too)."""
    cuts = [max(0, CUT * (q // CUT) - CUT) for q in positions.tolist()]
    if floor is not None:
        cuts = [min(b, CUT * (floor // CUT)) for b in cuts]
    cut = torch.tensor(cuts, dtype=torch.long, device=positions.device)
    cols = cut[:, None] + torch.arange(TAIL, device=positions.device)[None, :]
    past = (cols >= L) if max(cuts) + TAIL > L else None  # L not a multiple of CUT, or L < TAIL
    cols = cols.clamp(max=L - 1)
    slots = cols if order is None else order.gather(1, cols)
    return Canon(order, [(b, cut == b) for b in sorted(set(cuts))], cols, slots.reshape(-1), past)


def bias(mask: torch.Tensor, g: int) -> torch.Tensor:
    """[T, L] boolean canonical mask -> additive float32 bias [g * T, L] (0 or -inf), once per pass."""
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    return out.masked_fill_(~mask, float("-inf")).repeat(g, 1)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, bias_: torch.Tensor, scale: float,
              canon: Canon) -> torch.Tensor:
    """q [H, T, D]; k_cache/v_cache [KVH, S, D] in slot order (the first L slots attended);
    bias_ [G*T, L] in canonical order (see `bias`) -> [H, T, D]."""
    H, T, D = q.shape
    L = bias_.shape[-1]
    kvh = k_cache.shape[0]
    g = H // kvh
    order, tail_cols, groups, tail_past = canon.expanded(g)
    qg = (q * scale).reshape(kvh, g * T, D)
    s = torch.bmm(qg, k_cache[:, :L].transpose(1, 2))  # [KVH, G*T, L], slot order: dot products only
    if order is not None:
        s = s.gather(-1, order.expand(kvh, g * T, L))
    p = torch.softmax(s.add_(bias_), dim=-1)
    head = None  # the prefix part: a fixed [G*T, B] x [B, D] product per cut
    for b, rows in groups:
        if b == 0:
            continue
        part = torch.bmm(p[:, :, :b].contiguous(), v_cache[:, :b])
        if head is None:
            head = part if len(groups) == 1 else torch.where(rows, part, 0.0)
        else:
            head = torch.where(rows, part, head)
    pt = p.gather(-1, tail_cols.expand(kvh, g * T, TAIL))                    # [KVH, G*T, W]
    if tail_past is not None:
        pt.masked_fill_(tail_past, 0.0)
    pt = pt.reshape(kvh, g, T, TAIL).transpose(1, 2)                          # [KVH, T, G, W]
    flat = canon.flat_slots(kvh, v_cache.shape[1])  # a row gather on a 2-D view: 5-10x faster than dim 1
    vt = v_cache.view(-1, D).index_select(0, flat).reshape(kvh, T, TAIL, D)   # the rows' last values
    tail = torch.matmul(pt, vt).transpose(1, 2).reshape(kvh, g * T, D)      # per-row products
    out = tail if head is None else head + tail
    return out.reshape(H, T, D)
