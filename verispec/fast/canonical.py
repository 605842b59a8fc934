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

On the CPU with float32 caches, attend.py's kernel does the same in one call, summing every visible
column in position order (no cut needed); the PyTorch operations below run elsewhere (CUDA, float16
caches, no compiler). Either way a row's bits do not depend on its keys' slots, on the other rows or on L.

Cost: a few small kernels per layer instead of one fused attention call (see benchmarks/fast_decode.py
for exact mode's figure), used only in exact mode's eager passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verispec.fast import attend

TAIL = 128  # canonical columns summed per row (the cut B leaves at most 127 of them visible)
CUT = 64    # B is a multiple of this; a tree deeper than 64 still verifies right, maybe not bit-identically


@dataclass
class Canon:
    """Per-pass plan, built by the runner once and shared by all layers.

    order:     [T, L] long or None   canonical column -> cache slot (None: identity, a chain pass)
    positions: [T] long              the rows' positions
    L:         int                   the attended columns
    floor:     int or None           cuts may not pass this column (the first tree slot: columns below it
                                     are prefix in slot order too)

    The PyTorch operations' index tensors (`cuts`) are derived on first use: where attend.py's kernel
    runs, a pass needs only `order`.
    """

    order: torch.Tensor | None
    positions: torch.Tensor
    L: int
    floor: int | None = None
    _derived: dict = field(default_factory=dict)

    def cuts(self) -> tuple:
        """(groups, tail_cols, tail_slots, tail_past): groups the distinct cuts B as (B, rows: BoolTensor [T] of
        the rows with that cut); tail_cols [T, TAIL] the canonical columns B_r .. B_r + TAIL - 1 (clamped to
        L - 1), tail_slots [T * TAIL] their cache slots, tail_past [T, TAIL] bool the columns past L - 1 (clamped:
        they must add zero, not column L - 1 again, which a row at position L - 1 sees), or None when none is."""
        if "cuts" not in self._derived:
            L, dev = self.L, self.positions.device
            cuts = [max(0, CUT * (q // CUT) - CUT) for q in self.positions.tolist()]
            if self.floor is not None:
                cuts = [min(b, CUT * (self.floor // CUT)) for b in cuts]
            cut = torch.tensor(cuts, dtype=torch.long, device=dev)
            cols = cut[:, None] + torch.arange(TAIL, device=dev)[None, :]
            past = (cols >= L) if max(cuts) + TAIL > L else None  # L not a multiple of CUT, or L < TAIL
            cols = cols.clamp(max=L - 1)
            slots = cols if self.order is None else self.order.gather(1, cols)
            self._derived["cuts"] = ([(b, cut == b) for b in sorted(set(cuts))], cols, slots.reshape(-1), past)
        return self._derived["cuts"]

    def expanded(self, g: int) -> tuple:
        """(order, tail_cols, groups, tail_past) repeated for g query heads per kv head (built once per pass)."""
        if g not in self._derived:
            groups, tail_cols, _, tail_past = self.cuts()
            self._derived[g] = (None if self.order is None else self.order.repeat(g, 1),
                                tail_cols.repeat(g, 1),
                                [(b, rows.repeat(g)[:, None]) for b, rows in groups],
                                None if tail_past is None else tail_past.repeat(g, 1))
        return self._derived[g]

    def flat_slots(self, kvh: int, S: int) -> torch.Tensor:
        """tail_slots as rows of a [kvh * S, D] view of the cache."""
        key = ("flat", kvh, S)
        if key not in self._derived:
            heads = torch.arange(kvh, device=self.positions.device)[:, None] * S
            self._derived[key] = (heads + self.cuts()[2][None, :]).reshape(-1)
        return self._derived[key]


def plan(positions: torch.Tensor, L: int, order: torch.Tensor | None, floor: int | None = None) -> Canon:
    """positions [T] of the pass's rows; order as in Canon; floor: cuts may not pass this column (the
    first tree slot: columns below it are prefix in slot order too)."""
    return Canon(order, positions, L, floor)


def bias(mask: torch.Tensor, g: int) -> torch.Tensor:
    """[T, L] boolean canonical mask -> additive float32 bias [g * T, L] (0 or -inf), once per pass."""
    T, L = mask.shape
    # where + expand: Tensor.repeat costs several times a copy at these sizes
    return torch.where(mask, 0.0, float("-inf")).float().expand(g, T, L).reshape(g * T, L)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, bias_: torch.Tensor, scale: float,
              canon: Canon) -> torch.Tensor:
    """q [H, T, D]; k_cache/v_cache [KVH, S, D] in slot order (the first L slots attended);
    bias_ [G*T, L] in canonical order (see `bias`) -> [H, T, D]."""
    if attend.runs_on(k_cache):
        return attend.attention(q, k_cache, v_cache, bias_, scale, canon.order)
    return attention_ops(q, k_cache, v_cache, bias_, scale, canon)


def attention_ops(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, bias_: torch.Tensor, scale: float,
                  canon: Canon) -> torch.Tensor:
    """attention with PyTorch's operations (any device and dtype): the cut value sum described above."""
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
