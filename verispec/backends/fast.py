"""The fast backend: the Runner contract (base.py) over a fast family module (verispec/fast/) and a
preallocated KV cache.

The cache is one [2 * kv_heads, S, head_dim] tensor per layer (keys, then values), preallocated;
the position is the pointer: `length` says how many slots are valid, rollback moves it back, a tree path is compacted by an index
copy, and a tree is verified with its ancestor mask natively (each slot also records its position id,
so sliding windows and tree depths work from position ids, not slot numbers).

Shapes. Every pass runs T tokens (padding rows are computed and thrown away) and attends over the
first L slots of the cache with a [T, L] mask. In exact mode and compiled mode L is a multiple of
`kv_block` (masked slots add exact zeros, so a position's attention result does not depend on how far
L reaches); other passes attend over the filled slots rounded up to 16. kv_block is 512
by default because PyTorch's CPU flash attention splits the keys into blocks of 512 and rounds a
partly filled last block differently for different L (with kv_block 256 a position's logits changed
with how far L reached; docs/performance-notes.md; tests/test_fast.py checks the property across that
boundary). Eager mode uses the exact token
count; compiled mode pads to a few token buckets and marks L dynamic, so torch.compile makes one
graph per bucket for every length (the cache is then allocated in full up front; eager mode grows it
by doubling, a copy, as the sequence grows). Attending over the whole allocation instead cost about
twice as much per decode step (docs/performance-notes.md).

Exact mode (default for greedy decoding; PassMode says how a generation's passes run): every pass that returns logits runs exactly
`exact_bucket` tokens, so the GEMM kernels, which round differently for different row counts
(a 1-row float32 GEMM can differ in the last bits from the same row in a 4-row one), see
the same shapes in plain decoding and in verification, and attention runs canonical.py's layout-free
computation (a tree node's ancestors sit at other slots than plain decoding put them; the fused
attention kernels sum differently for that): greedy speculative output, chains and trees, is
bit-identical to plain decoding, in bfloat16 too (eager mode; compiled mode keeps the fused kernel,
so there only chains are). Its cost: every pass runs `exact_bucket` rows, unless the kernels prove
row-invariant at load (row_invariance.py probes the projections, the LM head and canonical attention;
here all are from 2 rows on, up to 32 and beyond), in which case a pass runs its natural row count,
never below the probe's floor and up to `exact_max_rows` (32) tokens: plain decoding computes 2
rows, not 8 (PassMode rows "natural"), a 16-node tree verifies in one pass, and canonical attention
costs more than the fused kernel (benchmarks/fast_decode.py has the figures). Turn it off with
FastRunner(exact=False) (API: build_engine(..., exact=False); CLI: --no-exact). Prefill
(last_only=True) is the same call in every method, so it runs in large chunks either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.backends.base import Forward, Runner, Scores, TreeMask, path_is_chain
from verispec.errors import InvalidPrompt
from verispec.fast import canonical, shared_fast_model
from verispec.fast.decoder import Part


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class PassMode:
    """How the passes that return logits run in one generation: made once per generation (FastRunner.reset,
    from the runner's exact setting and the sampling parameters) and read by every pass; prefill
    (last_only) runs its own row count over the filled slots in every mode.

    rows:      "natural" each pass runs its own row count, never below the kernels' row floor (where
                         row_invariance.py finds none, as "bucket")
               "bucket"  each pass runs exactly exact_bucket rows
               "own"     its own row count, not exact (compiled: the next token bucket)
    blocks:    attend over whole kv blocks (L a multiple of kv_block: a position's result does not depend
               on how far L reaches); False: over the filled slots rounded to 16
    canonical: canonical.py's layout-free attention (a tree node gets a chain's bits); False: fused SDPA
    """

    rows: str = "natural"
    blocks: bool = True
    canonical: bool = True

    @property
    def exact(self) -> bool:
        return self.rows != "own"

    @classmethod
    def of(cls, exact: bool, compiled: bool = False, natural_rows: bool = True, canonical: bool = True) -> "PassMode":
        """Exact mode on or off for a runner (compiled: torch.compile'd passes keep the fused kernel).
        natural_rows False: exact passes run exact_bucket rows; canonical False: fused attention."""
        if not exact:
            return cls(rows="own", blocks=compiled, canonical=False)
        canonical = canonical and not compiled
        return cls(rows="natural" if natural_rows and canonical else "bucket", blocks=True, canonical=canonical)


class FastRunner(Runner):
    """The Runner contract (backends/base.py) over a fast family module (verispec/fast/); its calls share
    forwards (batch_key, forward_together) where a sequence's bits stay its own."""

    can_features = True

    def __init__(self, model, capacity: int | None = None, exact: bool | PassMode | None = None, exact_bucket: int = 8,
                 exact_max_rows: int = 32,
                 compile: bool = False, buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
                 prefill_chunk: int = 256, kv_block: int = 512, weights: str | None = None, weight_source=None,
                 wide: bool = True, native: bool = True):
        """model: a loaded transformers causal LM of a supported family (its weights are shared).
        capacity: the most positions a sequence may hold (default: min(max positions, 4096)).
        exact: True / False / a PassMode for every generation, or None = exact mode for greedy decoding
        and not for sampling (chosen per generation by reset).
        weights: "bf16" (dense), "q8", "q4" (fast/quant.py), or None / "auto" (quant.resolve);
        weight_source: name -> a file's own weights (models/gguf_weights.py), None: the model's.
        wide: quantized weights keep a dense copy for prefill and for passes outside exact mode of
        quant.wide_rows(fmt) rows or more (FastDecoder); False saves its memory.
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
        self.fixed_mode = exact if isinstance(exact, PassMode) or exact is None else PassMode.of(bool(exact), compile)
        self.mode = self.fixed_mode or PassMode.of(True, compile)
        self.headroom = max(max(self.buckets), exact_bucket, exact_max_rows, prefill_chunk)  # padding rows write past the end
        self.slots_total = _round_up(self.capacity + self.headroom, kv_block)
        self.device = self.net.device
        self.kv: list[torch.Tensor] = []  # per layer [2 * kv_heads, S, head_dim]: keys, then values
        self.slot_pos = torch.zeros(0, dtype=torch.long, device=self.device)
        self._grow(self.slots_total if compile else min(self.slots_total, 4 * kv_block))
        self.length = 0

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
    def reset(self, params=None, mode: PassMode | None = None) -> None:
        """mode: this generation's PassMode (a benchmark measuring one); else the fixed one, or exact mode
        when params are greedy; neither params nor mode: the last generation's."""
        if mode is not None or params is not None:
            self.mode = mode or self.fixed_mode or PassMode.of(bool(params.greedy), self.compile)
        self.length = 0  # stale slots stay finite and are masked out

    def check_tree_support(self) -> None:
        """Trees are native here (an ancestor mask over the slots)."""

    def rollback(self, length: int) -> None:
        if length < self.length:
            self.length = max(0, int(length))

    @torch.inference_mode()  # the cache is an inference tensor once a forward has grown it
    def commit(self, start: int, keep: list[int] | torch.Tensor) -> None:
        if path_is_chain(keep):
            self.rollback(start + len(keep))
            return
        idx = torch.as_tensor(keep, dtype=torch.long, device=self.device) + start
        m = int(idx.numel())
        for cache in self.kv:
            cache[:, start:start + m] = cache.index_select(1, idx)  # index_select copies, so overlap is safe
        self.slot_pos[start:start + m] = self.slot_pos.index_select(0, idx)
        self.length = start + m

    @torch.inference_mode()
    def forward(self, ids, tree: TreeMask | None = None, *, last_only: bool = False,
                features: tuple[int, ...] = ()) -> Scores:
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).reshape(-1)
        if tree is None:
            return self._run(ids, None, None, last_only, features)
        start, anc, depths = tree.checked(int(ids.numel()), self.length, self.device)
        return self._run(ids, anc, start + depths[-ids.numel():], last_only, features, tree_start=start)

    # -- one call, cut into passes ------------------------------------------------------------------
    def _pass_size(self, remaining: int, last_only: bool) -> tuple[int, int]:
        """(tokens taken, padded bucket size) for the next pass."""
        if last_only:
            take = min(remaining, self.prefill_chunk)
            return take, take  # prefill runs eager at its exact size
        if self.mode.exact:
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
        """Exact mode's row floor where passes run their natural row count (row-invariant kernels up to
        exact_max_rows: row_invariance.py), else None."""
        if self.mode.rows != "natural":
            return None
        return self.net.row_floor(self.exact_max_rows, self.kv_block)

    def _mask(self, anc: torch.Tensor | None, rows: slice, T: int, L: int, pos: torch.Tensor, slots: torch.Tensor,
              tree_start: int, layout_free: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A pass's [T, L] mask and canonical order (column -> slot; None: the columns are the slots).
        rows: the pass's nodes among the tree's (anc's rows); the rows past them are padding."""
        cols = torch.arange(L, device=self.device)
        if anc is None:  # chain: causal over slots, whose slots are its positions
            return cols[None, :] <= slots[:, None], None
        width = min(anc.shape[1], L - tree_start)
        if layout_free:  # columns are positions: row i's ancestors are gathered to theirs
            order = cols.expand(T, L).clone()
            rr, jj = anc[rows, :width].nonzero(as_tuple=True)
            order[rr, self.slot_pos[tree_start + jj]] = tree_start + jj
            return cols[None, :] <= pos[:, None], order
        take = rows.stop - rows.start
        mask = (cols < tree_start)[None, :].expand(T, L).clone()
        mask[:take, tree_start:tree_start + width] = anc[rows, :width]
        mask[take:] = cols[None, :] <= slots[take:, None]  # padding rows: harmless causal rows
        return mask, None

    def _run(self, ids: torch.Tensor, anc: torch.Tensor | None, positions: torch.Tensor | None,
             last_only: bool, capture: tuple[int, ...], tree_start: int = 0) -> Scores:
        """ids [n]; chain (anc None: causal, positions length..) or tree (anc [n, C] over the slots from
        tree_start, positions [n])."""
        n = self._begin(ids, positions)
        out, feats = [], []
        c0 = 0
        while c0 < n:
            p = self._pass(ids, anc, c0, last_only, tree_start)
            (logits, got), = self.net.forward_parts([p.part], compiled=self.compile and not last_only,
                                                    capture=capture or None, wide=p.wide, native=self.native)
            logits, feat = p.outputs(logits, got, capture)
            if logits.shape[0]:
                out.append(logits)
            if capture:
                feats.append(feat)
            c0 = p.end
        self.length = self._base + n
        cat = lambda parts: parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)  # noqa: E731
        return Scores(cat(out), cat(feats) if capture else None)

    def _begin(self, ids: torch.Tensor, positions: torch.Tensor | None) -> int:
        """Check room for ids after the cached positions, grow the cache, note the call's positions -> n."""
        n = int(ids.numel())
        base = self.length
        if n == 0:
            raise ValueError("forward needs at least one token")
        if base + n > self.capacity:
            raise InvalidPrompt(f"the sequence would hold {base + n} positions but the fast cache holds "
                                f"{self.capacity}; shorten the prompt or raise capacity")
        need = _round_up(base + n + self.headroom, self.kv_block)
        if need > self.allocated:
            self._grow(min(self.slots_total, max(need, 2 * self.allocated)))
        self._base = base
        self._positions = torch.arange(base, base + n, device=self.device) if positions is None else positions
        return n

    def _pass(self, ids: torch.Tensor, anc: torch.Tensor | None, c0: int, last_only: bool, tree_start: int) -> "_Pass":
        """The next pass of a call (its tokens from c0 on), with the padding rows and mask its mode asks for."""
        dev, n, base, positions = self.device, int(ids.numel()), self._base, self._positions
        take, T = self._pass_size(n - c0, last_only)
        c1 = c0 + take
        first = base + c0  # first slot of this pass
        exact_shape = self.mode.exact and not last_only
        layout_free = self.mode.canonical and not last_only  # canonical.py: trees exact too
        # exact shapes attend in whole kv blocks (see the module docstring); other passes over the
        # filled slots only, rounded to whole SIMD vectors: a decode step's attention costs what the
        # slots it reads cost (docs/performance-notes.md)
        block = self.kv_block if self.mode.blocks and not last_only else 16
        L = min(self.allocated, _round_up(first + T, block))
        slots = torch.arange(first, first + T, device=dev)
        pos = torch.empty(T, dtype=torch.long, device=dev)
        pos[:take] = positions[c0:c1]
        pos[take:] = pos[take - 1]
        tok = torch.zeros(T, dtype=torch.long, device=dev)
        tok[:take] = ids[c0:c1]
        self.slot_pos[first:first + T] = pos
        mask, order = self._mask(anc, slice(c0, c1), T, L, pos, slots, tree_start, layout_free)
        canon = canonical.plan(pos, L, order, floor=None if anc is None else tree_start) if layout_free else None
        if last_only:
            rows = slice(take - 1, take) if c1 == n else slice(0, 0)
        else:
            rows = slice(0, T) if exact_shape else slice(0, take)
        part = Part(tok, pos, slots, mask, self.slot_pos, self.kv, rows, canon)
        return _Pass(part, c1, take, last_only, wide=self.wide and not exact_shape)

    # -- several runners in one forward (backends.forward_many) -----------------------------------
    def batch_key(self, call: Forward):
        """Runners with equal keys score their calls in one forward (forward_together): the same weights
        and pass mode, each call one eager pass; None: this call runs alone. In exact mode only where
        passes run natural row counts (row-invariant kernels), so a sequence's bits do not depend on the
        rows the other sequences bring."""
        if self.compile or (self.mode.exact and self._natural_floor() is None):
            return None
        n = len(call.ids)
        if self._pass_size(n, False)[0] < n:
            return None
        return id(self.net), self.mode, self.kv_block, self.exact_max_rows

    @staticmethod
    @torch.inference_mode()
    def forward_together(runners: list["FastRunner"], calls: list[Forward]) -> list[Scores]:
        """Score each runner's call (equal batch_key) in shared forwards: every sequence's pass rows, as
        alone, side by side in one pass; in exact mode at most exact_max_rows rows a pass (the row count
        the kernels were probed up to), so a batch may take several passes."""
        passes = []
        for r, call in zip(runners, calls):
            ids = torch.as_tensor(call.ids, dtype=torch.long, device=r.device).reshape(-1)
            anc, positions, start = None, None, 0
            if call.tree is not None:
                start, anc, depths = call.tree.checked(int(ids.numel()), r.length, r.device)
                positions = start + depths[-ids.numel():]
            r._begin(ids, positions)
            passes.append(r._pass(ids, anc, 0, False, start))
        cap = runners[0].exact_max_rows if runners[0].mode.exact else None
        groups, rows = [[]], 0
        for i, p in enumerate(passes):
            t = int(p.part.ids.shape[0])
            if groups[-1] and cap is not None and rows + t > cap:
                groups.append([])
                rows = 0
            groups[-1].append(i)
            rows += t
        capture = tuple(sorted(set().union(*(c.features for c in calls))))
        out: list[Scores | None] = [None] * len(runners)
        for group in groups:
            got = runners[0].net.forward_parts([passes[i].part for i in group], capture=capture or None,
                                               wide=all(passes[i].wide for i in group), native=False)
            for i, (logits, feats) in zip(group, got):
                r, call = runners[i], calls[i]
                logits, feat = passes[i].outputs(logits, feats, tuple(call.features))
                r.length = r._base + passes[i].take
                out[i] = Scores(logits, feat if call.features else None)
        return out


@dataclass
class _Pass:
    """One pass of a runner's call: the decoder's Part, where the call continues, the tokens it takes, and
    whether it may run the wide kernels (FastDecoder.forward)."""

    part: Part
    end: int
    take: int
    last_only: bool
    wide: bool

    def outputs(self, logits: torch.Tensor, captured: list, capture: tuple[int, ...]):
        """(the logits of the call's tokens, their features at `capture` or None) from the pass's results."""
        feat = None
        if capture:
            got = dict(captured)
            feat = torch.cat([got[i][:self.take] for i in capture], dim=-1)
        return (logits if self.last_only else logits[:self.take]), feat
