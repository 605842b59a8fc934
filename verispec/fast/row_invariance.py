"""Do the kernels of a pass give a row the same bits whatever number of rows shares the call? Probes.

Why. Exact mode (backends/fast.py) makes a position's logits independent of how many positions share its
pass. GEMM libraries pick kernels by the row count M and some of them sum a row's products in an
order that depends on M, so the safe answer is to run every pass at one fixed row count, which makes
plain decoding pay for 8 rows. But that is a property of the kernel, and it can be measured: on a
CPU with bf16 dot products oneDNN's prepacked linear can return bit-identical rows for every M from 2
up (a 1-row call may take another path; docs/performance-notes.md has what the probe found where).
Where the probe finds such a floor, exact mode runs the projections and the LM head at the pass's
natural row count (never below the floor). Canonical attention
(canonical.py) is probed alike: its score and value products are batched GEMMs whose row count is
the pass's (there too a 1-row pass can differ), so a pass runs
max(its tokens, the larger floor) rows.

The probe runs weights of the model's shapes at every M up to `max_rows` against one `max_rows`-row
call. Random inputs are not enough in bfloat16: two summation orders differ by an ulp of the float32
accumulator, which the rounding to a bfloat16 output hides except about once in 2^16 outputs (random
inputs passed at every M; the model's own activations did not at M = 1, K = 1536). So each probe row
cancels: its second half is the negated first half against duplicated weight columns, the exact
result is zero and what comes out is the rounding residue of the summation order, visible in any
dtype. GEMM kernels choose their order by shape, not by data, so the answer holds for the model's
activations; tests/test_fast_real.py checks the consequence (bit-identical greedy output with every
drafter) on the real model, tests/test_row_invariance.py that the probes catch row-dependent kernels.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch


def _cancelling(rows: int, out_f: int, in_f: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    h = in_f // 2
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    w[:, h:2 * h] = w[:, :h]
    x = torch.randn(rows, in_f, generator=g) * torch.exp(2 * torch.randn(rows, in_f, generator=g))
    x[:, h:2 * h] = -x[:, :h]
    x[:, 2 * h:] = 0
    return x, w


def _raise_floor(floor: int, max_rows: int, rows_of: Callable[[int], torch.Tensor]) -> int:
    """floor raised past the largest M >= floor whose call rows_of(M) differs from rows_of(max_rows)[:M]
    (rows_of returns the M rows with the row index first)."""
    ref = rows_of(max_rows)
    for m in range(max_rows - 1, floor - 1, -1):  # from the top: the floor is where agreement stops
        if not torch.equal(rows_of(m), ref[:m]):
            return m + 1
    return floor


@torch.inference_mode()
def row_floor(pack: Callable, linear: Callable, shapes: Iterable[tuple[int, int]], max_rows: int,
              dtype: torch.dtype, device: torch.device, seed: int = 0) -> int | None:
    """The smallest m such that, for a weight of every [out, in] shape (prepared by `pack`),
    linear(x[:M], w) equals linear(x, w)[:M] bit for bit for every M in m..max_rows (x of max_rows
    cancelling rows); None if even M = max_rows - 1 differs."""
    g = torch.Generator().manual_seed(seed)
    floor = 1
    for out_f, in_f in dict.fromkeys(shapes):
        x, w = _cancelling(max_rows, out_f, in_f, g)
        x, w = x.to(device=device, dtype=dtype), pack(w.to(device=device, dtype=dtype))
        floor = _raise_floor(floor, max_rows, lambda m: linear(x[:m], w))
        if floor >= max_rows:
            return None
    return floor


@torch.inference_mode()
def attention_row_floor(n_heads: int, n_kv_heads: int, head_dim: int, max_rows: int, lengths: Iterable[int],
                        dtype: torch.dtype, device: torch.device, seed: int = 0) -> int | None:
    """As row_floor, for canonical attention: a chain pass of M rows at positions p..p + M - 1 against
    the same rows of a max_rows-row pass, over each attended length L in `lengths` (a position early
    in L and one past the first cut of the value sum); float32 outputs show any other summation."""
    from verispec.fast import canonical

    g = torch.Generator().manual_seed(seed)
    floor = 1
    for L in lengths:
        k = torch.randn(n_kv_heads, L, head_dim, generator=g).to(device=device, dtype=dtype)
        v = torch.randn(n_kv_heads, L, head_dim, generator=g).to(device=device, dtype=dtype)
        q = torch.randn(n_heads, max_rows, head_dim, generator=g).to(device=device, dtype=dtype)
        for p0 in (max(0, L // 2 - 2 * canonical.CUT), L - max_rows):
            pos = torch.arange(p0, p0 + max_rows, device=device)
            mask = torch.arange(L, device=device)[None, :] <= pos[:, None]

            def rows_of(m):  # [H, M, D] -> [M, H, D]: rows first
                plan = canonical.plan(pos[:m], L, None)
                out = canonical.attention(q[:, :m].contiguous(), k, v, canonical.bias(mask[:m], n_heads // n_kv_heads),
                                          head_dim ** -0.5, plan)
                return out.transpose(0, 1)
            floor = _raise_floor(floor, max_rows, rows_of)
            if floor >= max_rows:
                return None
    return floor
