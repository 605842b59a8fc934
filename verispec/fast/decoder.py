"""The shared body of a fast family module: embed, run the layers over the static cache, norm, lm head.

A family module (llama.py, gemma3.py) only says how to read the weights of a loaded transformers model
and what differs per layer (sliding window, rotary table); this class runs them. Weights are shared
with the transformers model (no copy), except q/k/v and gate/up, which are concatenated once so each
becomes a single GEMM, and, on CPU, the projection and LM-head weights, which are prepacked once for
oneDNN's linear kernel (packed.py: 2-3x faster GEMVs there; a copy of those weights), or, with
`weights="q8"|"q4"`, quantized for PyTorch's weight-only int8 / int4 kernels (quant.py), from a GGUF's own
4-bit blocks where a weight source gives them (models/gguf_weights.py).
"""

from __future__ import annotations

import functools
import itertools
import logging
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from verispec.fast import attend, canonical, packed, quant, row_invariance
from verispec.fast import native as native_ext
from verispec.fast.core import Arch, layer_step, layer_step_parts, rms_norm, rope_tables

PROJECTIONS = ("wqkv", "wo", "wgu", "wdown")

log = logging.getLogger(__name__)

# exact mode's row floors (row_invariance.py) are a property of kernels and shapes, not of weights: probed
# once per process for each setting, not once per runner (the probe takes ~0.5-1 s on SmolLM2)
_ROW_FLOORS: dict[tuple, int | None] = {}


class FastDecoder:
    """Weights + static structure of one model; `forward` is a pure function of the cache it is given."""

    family = "base"

    def __init__(self, arch: Arch, embed: torch.Tensor, layers: list[dict], final_norm: torch.Tensor,
                 lm_head: torch.Tensor, windows: list[int | None], rope_keys: list[str],
                 ropes: dict[str, tuple[torch.Tensor, float]], embed_scale: float | None = None,
                 final_softcap: float | None = None, max_positions: int = 2048, weights: str = "bf16",
                 names: list[dict[str, tuple[str, ...]]] | None = None, lm_head_name: str = "lm_head.weight",
                 weight_source: Callable | None = None, wide: bool = True):
        """weights: "bf16" (the model's dense weights, packed where packed.py can), "q8" or "q4" (quant.py;
        falls back to "bf16" where quant.available says no, see `weights_note`). names: per layer, the
        transformers parameter names each projection is made of (wqkv: q, k, v); weight_source(name) ->
        quant.Groups, a float32 tensor or None (the file's own weights; None: the model's). wide: quantized
        formats keep a dense copy of their weights (dequantized, bfloat16, packed) for passes of at least
        quant.wide_rows(fmt) rows that may round otherwise than plain decoding (prefill, passes outside exact
        mode): the weight-only kernels' cost grows with the rows, the dense GEMM's hardly. Costs the
        memory of the dense weights again."""
        self.arch = arch
        self.dtype, self.device = embed.dtype, embed.device
        pack, dense_linear = packed.linear_for(embed.dtype, embed.device)
        self.linear = dense_linear
        self.weights, self.weights_note = "bf16", None
        if weights not in quant.FORMATS:
            raise ValueError(f"weights must be one of {', '.join(quant.FORMATS)}, got {weights!r}")
        if weights != "bf16":
            self.weights_note = quant.available(weights, embed.dtype, embed.device)
            if self.weights_note is None:
                self.weights, self.linear = weights, quant.linear
            else:
                log.warning("--weights %s unavailable: %s; running the dense %s weights", weights, self.weights_note,
                            str(embed.dtype).replace("torch.", ""))
        self.packed = self.linear is not F.linear
        # quantized formats: a dense copy of the same weights for passes of many rows (see `forward`)
        self.wide_rows: int | None = None
        self._dense: tuple | None = None  # (layers, lm head, linear, layer step) of that copy
        self._probe_shapes = tuple(tuple(layers[0][k].shape) for k in PROJECTIONS) + (tuple(lm_head.shape),)
        if self.weights == "bf16":
            self._probes = [(pack, self._probe_shapes)]  # (how the probe prepares a weight, its shapes)
            layers = [{k: pack(t) if k in PROJECTIONS else t for k, t in lw.items()} for lw in layers]
            lm_head = pack(lm_head)
        else:
            # shape -> the formats its weights got (layers may differ: a file's mixed tensor types); the
            # row-invariance probe runs every (shape, format) pair the forward runs
            self._kinds: dict[tuple, set[str]] = {}
            self.wide_rows = quant.wide_rows(self.weights) if wide else None
            dense_layers = []
            for i, lw in enumerate(layers):
                got = {k: self._quantize(t, names[i][k] if names else (), weight_source)
                       for k, t in lw.items() if k in PROJECTIONS}
                layers[i] = {**lw, **{k: q for k, (q, _) in got.items()}}
                if self.wide_rows:
                    dense_layers.append({**lw, **{k: pack(d.to(self.dtype)) for k, (_, d) in got.items()}})
            lm_head, dense_head = self._quantize(lm_head, (lm_head_name,), weight_source)
            if self.wide_rows:
                self._dense = (dense_layers, pack(dense_head.to(self.dtype)), dense_linear,
                               functools.partial(layer_step, a=arch, linear=dense_linear))
            formats = sorted(set().union(*self._kinds.values()))
            self._probes = [(functools.partial(quant.prepare, fmt=f, dtype=embed.dtype),
                             tuple(s for s, ks in self._kinds.items() if f in ks)) for f in formats]
        self.embed, self.layers, self.final_norm, self.lm_head = embed, layers, final_norm, lm_head
        self.windows, self.rope_keys, self.ropes = windows, rope_keys, ropes
        self.embed_scale, self.final_softcap = embed_scale, final_softcap
        self.max_positions = max_positions
        # bfloat16 attention on CPU runs several times slower than float32 at decode shapes
        # (docs/performance-notes.md); the keys and values are the model dtype's values stored exactly in
        # float32, so only the attention arithmetic is wider
        cpu_bf16 = self.device.type == "cpu" and self.dtype == torch.bfloat16
        self.cache_dtype = torch.float32 if cpu_bf16 else self.dtype
        self._step = functools.partial(layer_step, a=arch, linear=self.linear)
        self._compiled = None
        self._native_args: dict[int, list | None] = {}  # id(layers) -> native.layer_args of each layer, or None
        self._floors: dict[tuple, int | None] = {}  # row_floor's answers for this decoder, without rebuilding its key
        self._rope_tables: dict = {}  # rope key -> (cos, sin) [N, 1, head_dim] for positions 0 .. N - 1

    def _tables(self, pos: torch.Tensor) -> dict:
        """Rotary tables of the positions `pos` per rope key: rows of tables computed once for positions 0 .. N
        (rope_tables' operations are elementwise, so a position's row has the bits a per-pass computation
        gives it) and grown in steps of 1024 positions: a pass picks its rows with one index, not the
        dozen small operations of computing them."""
        need = int(pos.max()) + 1
        out = {}
        for key, (inv, scaling) in self.ropes.items():
            have = self._rope_tables.get(key)
            if have is None or have[0].shape[0] < need:
                n = -(-need // 1024) * 1024
                have = rope_tables(torch.arange(n, device=pos.device), inv, scaling, self.dtype)
                self._rope_tables[key] = have
            out[key] = (have[0][pos], have[1][pos])
        return out

    def _quantize(self, dense: torch.Tensor, names: tuple[str, ...], source: Callable | None):
        """A projection (the concatenation of the weights `names`) in self.weights' format, from the
        source's 4-bit groups where it has them for every part, else from its float32 weights, else from
        the model's. A dense weight from a file's source had no 4-bit blocks: it runs as int8 even in q4.
        -> (the quantized weight, the float32 weight it multiplies by)."""
        parts = [source(n) for n in names] if source is not None and names else []
        if parts and all(isinstance(p, quant.Groups) for p in parts):
            src, fmt = quant.Groups.cat(parts), self.weights
        elif parts and all(p is not None for p in parts):
            src = torch.cat([p.dense() if isinstance(p, quant.Groups) else p for p in parts])
            fmt = "q8"
        else:
            src, fmt = dense, self.weights
        q = quant.prepare(src, fmt, self.dtype)
        self._kinds.setdefault(tuple(dense.shape), set()).add("q4" if quant.is_int4(q) else "q8")
        return q, quant.dequantized(src, q) if self.wide_rows else None

    def streamed_bytes(self) -> int:
        """Bytes of weights one forward reads whole: the projections, norms and LM head in the format they
        run in (the embedding gives only its looked-up rows; packed.py's bf16 hybrid counts both its copies).
        Bytes / copy bandwidth is the floor of a forward."""
        def size(t) -> int:
            if isinstance(t, torch.Tensor):
                return t.numel() * t.element_size()
            return sum(size(x) for x in t) if isinstance(t, (tuple, list)) else 0
        return sum(size(t) for lw in self.layers for t in lw.values()) + size(self.lm_head) + size(self.final_norm)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def new_cache(self, slots: int) -> list[torch.Tensor]:
        """One [2 * kv_heads, slots, head_dim] tensor per layer: keys in rows :kv_heads, values after, so
        a pass writes both with one copy."""
        a = self.arch
        shape = (2 * a.n_kv_heads, slots, a.head_dim)
        return [torch.zeros(shape, dtype=self.cache_dtype, device=self.device) for _ in self.layers]

    def row_floor(self, max_rows: int, kv_block: int) -> int | None:
        """The fewest rows from which an exact-mode pass gives every row the same bits at any row count up
        to max_rows: the projections, the LM head and canonical attention over one and two kv blocks
        (row_invariance.py; probed once per setting), or None."""
        quick = (self.linear, max_rows, kv_block, torch.get_num_threads())  # the rest of the key is fixed at init
        if quick in self._floors:
            return self._floors[quick]
        a = self.arch
        # the kernels' split of the work may follow the thread count
        probes = tuple((getattr(p, "keywords", {}).get("fmt"), tuple(s)) for p, s in self._probes)
        key = (self.linear, self.weights, probes, self._probe_shapes, a.n_heads, a.n_kv_heads, a.head_dim, self.dtype, self.cache_dtype,
               str(self.device), max_rows, kv_block, torch.get_num_threads())
        if key not in _ROW_FLOORS:
            floors = [row_invariance.row_floor(pack, self.linear, shapes, max_rows, self.dtype, self.device)
                      for pack, shapes in self._probes]
            lin = None if None in floors else max(floors)
            att = row_invariance.attention_row_floor(a.n_heads, a.n_kv_heads, a.head_dim, max_rows,
                                                     (kv_block, 2 * kv_block), self.cache_dtype, self.device)
            _ROW_FLOORS[key] = None if lin is None or att is None else max(lin, att)
        self._floors[quick] = _ROW_FLOORS[key]
        return self._floors[quick]

    def _native_layers(self, layers: list[dict], linear: Callable) -> list | None:
        """native.layer_args of every layer (the quantized weights or their dense copy), None where the
        extension is not built or does not cover a layer."""
        if id(layers) not in self._native_args:
            args = [native_ext.layer_args(self.arch, linear, lw) for lw in layers] if native_ext.module() else [None]
            self._native_args[id(layers)] = None if None in args else args
        return self._native_args[id(layers)]

    def _native_shape(self) -> tuple:
        a = self.arch
        return a.n_heads, a.n_kv_heads, a.head_dim, a.eps, a.scale

    def compiled_step(self):
        """The layer step under torch.compile (one graph per token bucket, shared by all layers)."""
        if self._compiled is None:
            import torch._dynamo

            # one graph per (bucket, dtype); the default limit of 8 would fall back to eager silently
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            step = functools.partial(layer_step, a=self.arch, linear=packed.for_compile(self.linear))
            self._compiled = torch.compile(step, dynamic=None, fullgraph=True)
        return self._compiled

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
                slot_pos: torch.Tensor, kv: list[torch.Tensor],
                rows: torch.Tensor | slice | None = None, compiled: bool = False,
                capture: tuple[int, ...] | None = None, captured: list | None = None,
                canon=None, wide: bool = False, native: bool = False) -> torch.Tensor:
        """ids/pos/slots [T], mask [T, L] (causal or tree, before sliding windows), slot_pos [S] the
        position id held by each cache slot (already updated for `slots`), kv the caches of new_cache ->
        logits [rows, V] float32: one sequence's pass (forward_parts with one Part).

        capture: hidden-state indices (transformers' numbering: i = output of layer i - 1, n_layers = the
        final normed state) whose [T, hidden] rows are appended to `captured` (drafters reading features).
        canon: a canonical.Canon plan (eager exact mode); `mask` is then over canonical columns, where
        column c holds position c.
        wide: the pass may run other kernels than plain decoding's (prefill, passes outside exact mode): with
        quantized weights, T >= wide_rows then runs their dense copy (eager only).
        native: eager passes run the layers through native.py's C++ step where it is built and covers
        this model (the same operations, so the same bits as layer_step)."""
        (logits, got), = self.forward_parts([Part(ids, pos, slots, mask, slot_pos, kv, rows, canon)], compiled=compiled,
                                            capture=capture, wide=wide, native=native)
        if capture:
            captured.extend(got)
        return logits

    def _masks(self, part: "Part") -> dict[int | None, torch.Tensor]:
        """A part's attention masks per sliding window (None: the full mask), as the additive biases (or the
        canonical plan's biases) every layer's attention takes."""
        mask, pos, canon = part.mask, part.pos, part.canon
        masks: dict[int | None, torch.Tensor] = {None: mask}
        L = mask.shape[-1]
        key_pos = part.slot_pos[:L] if canon is None else torch.arange(L, device=mask.device)
        for w in set(self.windows):
            if w is not None:  # sliding window from position ids, so tree nodes and compacted paths work alike
                masks[w] = mask & ((pos[:, None] - key_pos[None, :]) < w)
        if canon is not None:
            g = self.arch.n_heads // self.arch.n_kv_heads
            return {key: canonical.bias(m, g) for key, m in masks.items()}
        # additive, once per pass: a boolean mask is converted inside every layer's attention call
        return {key: torch.zeros(m.shape, dtype=self.cache_dtype, device=m.device).masked_fill_(~m, float("-inf"))
                for key, m in masks.items()}

    def forward_parts(self, parts: list["Part"], compiled: bool = False, capture: tuple[int, ...] | None = None,
                      wide: bool = False, native: bool = False) -> list[tuple[torch.Tensor, list]]:
        """One pass over the rows of one or several sequences (a batch), each Part over its own cache ->
        per part (logits [its rows, V] float32, [(layer index, [T, hidden] features)] for `capture`).

        Embedding, norms, projections, MLP and LM head run over all parts' rows at once; attention per
        part. One part may take the native whole-stack call or the compiled step; several run the Python
        step (core.layer_step_parts), whose operations per row are layer_step's. The other arguments as
        in `forward`; wide and the dense copy look at all rows of the pass."""
        sizes = [int(p.ids.shape[0]) for p in parts]
        step = self.compiled_step() if compiled else self._step
        layers, lm_head, linear = self.layers, self.lm_head, self.linear
        if wide and not compiled and self._dense is not None and sum(sizes) >= self.wide_rows:
            layers, lm_head, linear, step = self._dense
        one = len(parts) == 1
        if compiled:
            if not one:
                raise ValueError("compiled passes run one sequence at a time")
            torch._dynamo.maybe_mark_dynamic(parts[0].mask, 1)  # "maybe": L may equal the whole allocation
        ids = parts[0].ids if one else torch.cat([p.ids for p in parts])
        pos = parts[0].pos if one else torch.cat([p.pos for p in parts])
        x = F.embedding(ids, self.embed)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale).to(self.dtype)  # float32 scalar cast, as transformers does
        tables = self._tables(pos)
        masks = [self._masks(p) for p in parts]
        bounds = [slice(a, a + n) for a, n in zip([0] + list(itertools.accumulate(sizes))[:-1], sizes)]
        captured: list[list] = [[] for _ in parts]
        p0 = parts[0]
        args = self._native_layers(layers, linear) if native and not compiled and one else None
        if args is not None:  # the whole stack in one native call, or one per stretch between captured layers
            kv, slots, canon, m0 = p0.kv, p0.slots, p0.canon, masks[0]
            keys, wins = sorted(tables), sorted(m0, key=str)
            per_layer = [*zip(*args), kv, [keys.index(k) for k in self.rope_keys], [wins.index(w) for w in self.windows]]
            shared = ([tables[k][0] for k in keys], [tables[k][1] for k in keys], [m0[w] for w in wins])
            if canon is not None and not attend.runs_on(kv[0]):
                a = self.arch
                order, tail_cols, groups, tail_past = canon.expanded(a.n_heads // a.n_kv_heads)
                flat = canon.flat_slots(a.n_kv_heads, kv[0].shape[1])
            cuts = sorted({0, len(layers), *(i for i in capture or () if 0 < i < len(layers))})
            for lo, hi in zip(cuts, cuts[1:]):
                ws, kinds, bqkv, bo, kv_, table_of, mask_of = (v[lo:hi] for v in per_layer)
                common = (x, ws, kinds, bqkv, bo, kv_, slots, *shared, table_of, mask_of)
                if canon is None:
                    x = native_ext.module().layers(*common, *self._native_shape())
                elif attend.runs_on(kv[0]):  # attend.py's kernel: the plan's order is all it needs
                    none = attend.NO_ORDER
                    x = native_ext.module().layers_canonical(*common, canon.order, none, [], [], None, none, True,
                                                             *self._native_shape())
                else:
                    x = native_ext.module().layers_canonical(
                        *common, order, tail_cols, [b for b, _ in groups], [r for _, r in groups], tail_past, flat,
                        False, *self._native_shape())
                if capture and hi in capture and hi < len(layers):
                    captured[0].append((hi, x))
            layers = []
        for i, lw in enumerate(layers):
            cos, sin = tables[self.rope_keys[i]]
            win = self.windows[i]
            if not one:
                x = layer_step_parts(x, lw, [(b, p.kv[i], p.slots, m[win], p.canon) for b, p, m in zip(bounds, parts, masks)],
                                     cos, sin, self.arch, linear)
            else:
                x = step(x, lw, p0.kv[i], p0.slots, cos, sin, masks[0][win], canon=p0.canon)
            if capture and i + 1 in capture and i + 1 < len(self.layers):
                for got, b in zip(captured, bounds):
                    got.append((i + 1, x[b]))
        if capture and len(self.layers) in capture:
            final = rms_norm(x, self.final_norm, self.arch.eps, self.arch.gemma_norm)
            for got, b in zip(captured, bounds):
                got.append((len(self.layers), final[b]))
        picked = [x[b] if p.rows is None else x[b][p.rows] for b, p in zip(bounds, parts)]
        x = picked[0] if one else torch.cat(picked)
        x = rms_norm(x, self.final_norm, self.arch.eps, self.arch.gemma_norm)
        logits = linear(x, lm_head).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        out = [logits] if one else list(logits.split([int(t.shape[0]) for t in picked]))
        return list(zip(out, captured))


class Part(NamedTuple):
    """One sequence's rows in a pass (FastDecoder.forward_parts) and where they go: ids/pos/slots [T],
    mask [T, L] over its own cache (causal or tree, before sliding windows), slot_pos [S] the position id
    of each of its cache slots, kv its caches (new_cache), rows the rows whose logits are wanted (None:
    all), canon its canonical.Canon plan (exact mode) or None."""

    ids: torch.Tensor
    pos: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor
    slot_pos: torch.Tensor
    kv: list
    rows: torch.Tensor | slice | None = None
    canon: object = None
