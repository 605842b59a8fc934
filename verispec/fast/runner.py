"""FastRunner: the engine's runner interface over a fast family module and a preallocated KV cache.

The cache is one [2 * kv_heads, S, head_dim] tensor per layer (keys, then values), preallocated;
the position is the pointer: `length` says how many slots are valid, rollback moves it back, a tree path is compacted by an index
copy, and a tree is verified with its ancestor mask natively (each slot also records its position id,
so sliding windows and tree depths work from position ids, not slot numbers).

Shapes. Every pass runs T tokens (padding rows are computed and thrown away) and attends over the
first L slots of the cache with a [T, L] mask. In exact mode and compiled mode L is a multiple of
`kv_block` (masked slots add exact zeros, so a position's attention result does not depend on how far
L reaches); other passes attend over the filled slots rounded up to 16. kv_block is 512
by default because PyTorch's CPU flash attention splits the keys into blocks of 512 and rounds a
partly filled last block differently for different L: with kv_block 256, SmolLM2's logits at
positions 762-765 changed when the pass attended over 768 slots instead of 1024 (measured 2026-12-03;
tests/test_fast.py checks the property across that boundary). Eager mode uses the exact token
count; compiled mode pads to a few token buckets and marks L dynamic, so torch.compile makes one
graph per bucket for every length (the cache is then allocated in full up front; eager mode grows it
by doubling, a copy, as the sequence grows). Attending over the whole allocation instead cost 2.3x
per decode step (measured 2026-12-03, SmolLM2 bf16: 56 ms vs 30 ms).

Exact mode (default for greedy decoding, see `prepare`): every pass that returns logits runs exactly
`exact_bucket` tokens, so the GEMM kernels, which round differently for different row counts
(measured here: a 1-row float32 GEMM differs in the last bits from the same row in a 4-row one), see
the same shapes in plain decoding and in verification, and attention runs canonical.py's layout-free
computation (a tree node's ancestors sit at other slots than plain decoding put them; the fused
attention kernels sum differently for that): greedy speculative output, chains and trees, is
bit-identical to plain decoding, in bfloat16 too (eager mode; compiled mode keeps the fused kernel,
so there only chains are). Its cost: every pass runs `exact_bucket` rows, unless the kernels prove
row-invariant at load (row_invariance.py probes the projections, the LM head and canonical attention;
here all are from 2 rows on, up to 32 and beyond), in which case a pass runs its natural row count,
never below the probe's floor and up to `exact_max_rows` (32) tokens: plain decoding computes 2
rows, not 8 (`natural_rows`), a 16-node tree verifies in one pass, and canonical attention
costs more than the fused kernel (benchmarks/fast_decode.py has the figures). Turn it off with
FastRunner(exact=False) (API: build_engine(..., exact=False); CLI: --no-exact). Prefill
(last_only=True) is the same call in every method, so it runs in large chunks either way.
"""

from __future__ import annotations

import threading
import weakref

import torch

from verispec.errors import InvalidPrompt, UnsupportedModel
from verispec.fast import canonical


def build_fast_model(model, **weight_options):
    """The fast family module for a loaded transformers model, or UnsupportedModel saying why not.
    weight_options: weights ("bf16", "q8", "q4"), weight_source and wide (see FastDecoder)."""
    from verispec.fast import gemma3, llama

    for mod, cls in ((llama, "FastLlama"), (gemma3, "FastGemma3")):
        if getattr(model.config, "model_type", None) in mod.MODEL_TYPES:
            reason = mod.unsupported_reason(model)
            if reason:
                raise UnsupportedModel(f"fast backend: {reason}; use backend 'hf'")
            return getattr(mod, cls)(model, **weight_options)
    raise UnsupportedModel(f"fast backend: model type {getattr(model.config, 'model_type', None)!r} is not "
                           "supported (Llama family, Qwen2/3, Mistral, Gemma 3); use backend 'hf'")


# Runners of one model share its fast module: the fused and packed (or quantized) weights, a copy as
# large as the model, are built once per model and weight setting, and each runner adds only its KV
# cache. Keyed weakly by the transformers model; the key also holds the kernels packed.py picks now
# (VERISPEC_PACKED, a test forcing the bf16 hybrid) and the parameters' version counters, so a model
# changed in place gets a fresh module.
_SHARED: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


def shared_fast_model(model, weights: str = "bf16", weight_source=None, wide: bool = True):
    """build_fast_model(model, ...), built once per model and setting and shared by its runners."""
    from verispec.fast import packed

    p = next(model.parameters())
    source = getattr(weight_source, "__self__", weight_source)  # a bound method is new on every access
    version = sum(t._version for t in model.parameters())
    key = (weights, id(source) if source is not None else None, wide, packed.linear_for(p.dtype, p.device), version)
    with _SHARED_LOCK:
        built = {k: v for k, v in _SHARED.get(model, {}).items() if k[-1] == version}  # stale ones go
        if key not in built:
            built[key] = build_fast_model(model, weights=weights, weight_source=weight_source, wide=wide)
        _SHARED[model] = built
        return built[key]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class FastRunner:
    def __init__(self, model, capacity: int | None = None, exact: bool | None = None, exact_bucket: int = 8,
                 exact_max_rows: int = 32,
                 compile: bool = False, buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
                 prefill_chunk: int = 256, kv_block: int = 512, weights: str | None = None, weight_source=None,
                 wide: bool = True, native: bool = True):
        """model: a loaded transformers causal LM of a supported family (its weights are shared).
        capacity: the most positions a sequence may hold (default: min(max positions, 4096)).
        exact: True / False, or None = on for greedy and off for sampling (set by `prepare`).
        weights: "bf16" (dense), "q8", "q4" (fast/quant.py), or None / "auto" (quant.resolve);
        weight_source: name -> a file's own weights (models/gguf_weights.py), None: the model's.
        wide: quantized weights keep a dense copy for prefill and for passes outside exact mode of
        quant.WIDE_ROWS rows or more (FastDecoder); False saves its memory.
        native: eager passes run the layers through native.py's C++ step where it is built (the same
        operations as core.layer_step, so the same bits); False: the Python step."""
        from verispec.fast import quant

        p = next(model.parameters())
        fmt = quant.resolve(weights, p.dtype, p.device, weight_source is not None)
        self.net = shared_fast_model(model, weights=fmt, weight_source=weight_source, wide=wide)
        if exact_bucket < 1 or exact_max_rows < 1 or any(b < 1 for b in buckets):
            raise ValueError("buckets must be positive")
        if kv_block % 16:  # whole SIMD vectors, so reductions over L keep their association as L grows
            raise ValueError("kv_block must be a multiple of 16")
        self.capacity = int(capacity or min(self.net.max_positions, 4096))
        self.buckets = tuple(sorted(set(buckets)))
        self.exact_bucket, self.prefill_chunk, self.kv_block = exact_bucket, prefill_chunk, kv_block
        # the most tokens of one exact pass at natural row counts: a tree of 16-32 nodes verifies in one
        # pass, not in chunks of exact_bucket (two passes for the 16-node trees the bench uses)
        self.exact_max_rows = exact_max_rows
        self.compile = compile
        self.native, self.wide = native, wide
        self.exact_setting = exact
        self.exact = True if exact is None else bool(exact)
        self.canonical = True  # exact mode's layout-independent attention (canonical.py); False: fused SDPA
        # exact mode: where the kernels are row-invariant (row_invariance.py), passes run their natural row
        # count (never below the probe's floor); False: every pass runs exact_bucket rows
        self.natural_rows = True
        self.headroom = max(max(self.buckets), exact_bucket, exact_max_rows, prefill_chunk)  # padding rows write past the end
        self.slots_total = _round_up(self.capacity + self.headroom, kv_block)
        self.device = self.net.device
        self.kv: list[torch.Tensor] = []  # per layer [2 * kv_heads, S, head_dim]: keys, then values
        self.slot_pos = torch.zeros(0, dtype=torch.long, device=self.device)
        self._grow(self.slots_total if compile else min(self.slots_total, 4 * kv_block))
        self.length = 0
        self.last_hidden_states = None
        # as HFRunner: hidden-state indices kept from every forward for drafters that read target features
        self.feature_layers: tuple[int, ...] | None = None
        self.last_features = None

    @property
    def allocated(self) -> int:
        return int(self.slot_pos.numel())

    @property
    def k(self) -> list[torch.Tensor]:
        """Per layer [kv_heads, S, head_dim] views of the cached keys."""
        return [t[: self.net.arch.n_kv_heads] for t in self.kv]

    @property
    def v(self) -> list[torch.Tensor]:
        return [t[self.net.arch.n_kv_heads:] for t in self.kv]

    def _grow(self, slots: int) -> None:
        """Reallocate the cache to `slots` slots, keeping what it holds (rare: sizes double)."""
        old = self.allocated
        kv = self.net.new_cache(slots)
        for new, cur in zip(kv, self.kv):
            new[:, :old] = cur
        pos = torch.zeros(slots, dtype=torch.long, device=self.device)
        pos[:old] = self.slot_pos
        self.kv, self.slot_pos = kv, pos

    # -- the runner interface -------------------------------------------------------------------
    def prepare(self, params) -> None:
        """Called by the engine before a generation: exact mode follows greedy unless fixed."""
        if self.exact_setting is None:
            self.exact = bool(getattr(params, "greedy", True))

    def reset(self) -> None:
        self.length = 0  # stale slots stay finite and are masked out

    def crop(self, length: int) -> None:
        if length < self.length:
            self.length = max(0, int(length))

    @torch.inference_mode()  # the cache is an inference tensor once a forward has grown it
    def compact(self, start: int, keep: list[int] | torch.Tensor) -> None:
        """Move the entries at slots start + keep[i] to slot start + i; length becomes start + len(keep)."""
        idx = torch.as_tensor(keep, dtype=torch.long, device=self.device) + start
        m = int(idx.numel())
        for cache in self.kv:
            cache[:, start:start + m] = cache.index_select(1, idx)  # index_select copies, so overlap is safe
        self.slot_pos[start:start + m] = self.slot_pos.index_select(0, idx)
        self.length = start + m

    @torch.inference_mode()
    def forward(self, ids, last_only: bool = False) -> torch.Tensor:
        """ids [n] appended after the cached positions -> logits [n, V] (or [1, V] with last_only)."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).reshape(-1)
        return self._run(ids, None, None, last_only)

    @torch.inference_mode()
    def forward_tree(self, ids, ancestor_mask: torch.Tensor, depths: torch.Tensor,
                     tree_start: int | None = None) -> torch.Tensor:
        """n tree nodes at slots length..length+n-1; node i sees the cache and node j iff
        ancestor_mask[i, j]; its position id is length + depths[i]. -> logits [n, V].

        tree_start (as HFRunner: drafters that grow a tree over several calls): the slots from
        tree_start on hold earlier nodes of the same tree; ancestor_mask is then [n, length - tree_start + n]
        over those slots and the new ones, depths covers them too, and positions are tree_start + depths.
        """
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).reshape(-1)
        n = int(ids.numel())
        start = self.length if tree_start is None else int(tree_start)
        cols = self.length - start + n
        anc = torch.as_tensor(ancestor_mask, dtype=torch.bool).to(self.device)
        depths = torch.as_tensor(depths, dtype=torch.long).to(self.device).reshape(-1)
        if not 0 <= start <= self.length or anc.shape != (n, cols) or depths.numel() != cols:
            raise ValueError(f"tree of {n} new nodes over {cols} tree slots needs ancestor_mask [{n}, {cols}] "
                             f"and depths [{cols}], got {tuple(anc.shape)} and {tuple(depths.shape)}")
        return self._run(ids, anc, start + depths[cols - n:], False, tree_start=start)

    # -- one call, cut into passes ------------------------------------------------------------------
    def _pass_size(self, remaining: int, last_only: bool) -> tuple[int, int]:
        """(tokens taken, padded bucket size) for the next pass."""
        if last_only:
            take = min(remaining, self.prefill_chunk)
            return take, take  # prefill runs eager at its exact size
        if self.exact:
            floor = self._natural_floor()
            if floor is not None:  # row-invariant kernels: the natural row count, never below the floor
                take = min(remaining, self.exact_max_rows)
                return take, max(take, floor)
            take = min(remaining, self.exact_bucket)
            return take, self.exact_bucket
        take = min(remaining, self.buckets[-1])
        if not self.compile:
            return take, take
        return take, next(b for b in self.buckets if b >= take)

    def _natural_floor(self) -> int | None:
        """Exact mode's row floor where passes run their natural row count (eager, canonical attention,
        row-invariant kernels up to exact_max_rows: row_invariance.py), else None."""
        if not self.natural_rows or self.compile or not self.canonical:
            return None
        return self.net.row_floor(self.exact_max_rows, self.kv_block)

    def _run(self, ids: torch.Tensor, anc: torch.Tensor | None, positions: torch.Tensor | None,
             last_only: bool, tree_start: int = 0) -> torch.Tensor:
        """ids [n]; chain (anc None: causal, positions length..) or tree (anc [n, C] over the slots from
        tree_start, positions [n])."""
        n = int(ids.numel())
        base = self.length
        if n == 0:
            raise ValueError("forward needs at least one token")
        if base + n > self.capacity:
            raise InvalidPrompt(f"the sequence would hold {base + n} positions but the fast cache holds "
                                f"{self.capacity}; shorten the prompt or raise capacity")
        dev = self.device
        need = _round_up(base + n + self.headroom, self.kv_block)
        if need > self.allocated:
            self._grow(min(self.slots_total, max(need, 2 * self.allocated)))
        if positions is None:
            positions = torch.arange(base, base + n, device=dev)
        out = []
        feats: list[torch.Tensor] = []
        c0 = 0
        while c0 < n:
            take, T = self._pass_size(n - c0, last_only)
            c1 = c0 + take
            first = base + c0  # first slot of this pass
            exact_shape = self.exact and not last_only
            compiled = self.compile and not last_only
            layout_free = exact_shape and not compiled and self.canonical  # canonical.py: trees exact too
            # exact shapes attend in whole kv blocks (see the module docstring); other passes over the
            # filled slots only, rounded to whole SIMD vectors (T = 1 after 200 tokens: 36 us per layer
            # over 208 slots vs 80 us over 512, measured 2026-12-03)
            block = self.kv_block if exact_shape or compiled else 16
            L = min(self.allocated, _round_up(first + T, block))
            slots = torch.arange(first, first + T, device=dev)
            pos = torch.empty(T, dtype=torch.long, device=dev)
            pos[:take] = positions[c0:c1]
            pos[take:] = pos[take - 1]
            tok = torch.zeros(T, dtype=torch.long, device=dev)
            tok[:take] = ids[c0:c1]
            self.slot_pos[first:first + T] = pos
            cols = torch.arange(L, device=dev)
            order = None  # canonical column -> slot; None: a chain, whose slots are its positions
            if anc is None:  # chain: causal over slots
                mask = cols[None, :] <= slots[:, None]
            elif layout_free:  # columns are positions: row i's ancestors are gathered to theirs
                width = min(anc.shape[1], L - tree_start)
                order = cols.expand(T, L).clone()
                rr, jj = anc[c0:c1, :width].nonzero(as_tuple=True)
                order[rr, self.slot_pos[tree_start + jj]] = tree_start + jj
                mask = cols[None, :] <= pos[:, None]
            else:
                mask = (cols < tree_start)[None, :].expand(T, L).clone()
                width = min(anc.shape[1], L - tree_start)
                mask[:take, tree_start:tree_start + width] = anc[c0:c1, :width]
                mask[take:] = cols[None, :] <= slots[take:, None]  # padding rows: harmless causal rows
            canon = canonical.plan(pos, L, order, floor=None if anc is None else tree_start) if layout_free else None
            if last_only:
                rows = slice(take - 1, take) if c1 == n else slice(0, 0)
            else:
                rows = slice(0, T) if exact_shape else slice(0, take)
            captured: list = []
            logits = self.net.forward(tok, pos, slots, mask, self.slot_pos, self.kv, rows=rows,
                                      compiled=compiled, capture=self.feature_layers, captured=captured,
                                      canon=canon, wide=self.wide and not exact_shape, native=self.native)
            if self.feature_layers:
                got = dict(captured)
                feats.append(torch.cat([got[i][:take] for i in self.feature_layers], dim=-1))
            if not last_only:
                logits = logits[:take]
            if logits.shape[0]:
                out.append(logits)
            c0 = c1
        self.length = base + n
        if self.feature_layers:
            self.last_features = feats[0] if len(feats) == 1 else torch.cat(feats, dim=0)
        return out[0] if len(out) == 1 else torch.cat(out, dim=0)
