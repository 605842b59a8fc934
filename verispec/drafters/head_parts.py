"""The parts the drafters on the target's hidden features share (the EAGLE head, the Medusa heads, the
block drafter): their layers, which target layers they read, the queue of features the engine hands
over, packed weight copies, loading, and the draft-vocabulary side of choosing tokens (a chain's, and
tree children's for the tree builder, tree.build).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from verispec.drafters.base import Drafter
from verispec.errors import HeadMismatch
from verispec.fast import norm, rope
from verispec.sampling import logits_to_probs, sample
from verispec.types import SamplingParams


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if norm.runs_on(x) and x.dtype == self.weight.dtype and not (
                torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            # drafting: one kernel call for the half-dozen operations below (the same arithmetic, the sum of
            # squares in its own order); training keeps the operations, which autograd differentiates
            return norm.rms_norm(x, self.weight, self.eps)
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotary(pos: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables of positions pos [..., T] -> cos, sin [..., 1, T, hd] in dtype (sin's first half
    negated, so that rotation is x * cos + roll(x, hd / 2) * sin: fast/rope.py's form), for rotate."""
    freqs = pos.float()[..., None] * inv_freq  # [..., T, hd/2]
    cos, sin = freqs.cos(), freqs.sin()
    return (torch.cat([cos, cos], dim=-1).unsqueeze(-3).to(dtype),
            torch.cat([-sin, sin], dim=-1).unsqueeze(-3).to(dtype))


def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotary embedding of x [..., heads, T, hd] with the tables of its positions (rotary) -> same shape."""
    return rope.rotate(x, *tables)


def default_feature_layers(num_hidden_layers: int) -> list[int]:
    """Hidden-state indices (transformers' numbering: i = output of decoder layer i - 1) of a low, a
    middle and a high layer, the choice of EAGLE-3's reference code (layers 2, L/2, L-3)."""
    L = num_hidden_layers
    return sorted({min(3, L), max(1, L // 2 + 1), max(1, L - 2)})


class PackedLinears:
    """A module whose linear layers (self.fc among them) can run from packed weight copies."""

    _packed: dict | None = None  # name -> (inference copy of the weight, the linear that applies it): pack_for_inference

    def pack_for_inference(self, dtype: torch.dtype, quantized: bool = False) -> None:
        """Draft with copies of the linear weights in `dtype`, in oneDNN's layout on CPU (fast/packed.py).
        F.linear reads float32 weights far below the memory bandwidth on CPU, which made the weight reads
        most of an EAGLE step's drafting time. quantized (the target runs quantized weights): 8 bits per
        weight with a scale per output channel, on the target's quantized kernel where the format runs
        (fast/quant.py; half the bytes of bf16, and on CPUs without bf16 instructions ~5x faster than the
        bf16 copy); the verification keeps the output lossless whatever the head computes. The trained
        parameters are untouched (training and saving never see the copies); activations stay float32
        between the linears (qmm.py's 8-bit kernel reads them as they are; the other copies take them in
        `dtype`). Linears that read the same input (a layer's q, k and v; gate and up) also get one copy
        of their weights stacked, so that `lins` applies them in one call (one pass over the input, one
        kernel call instead of three; per output channel the same arithmetic)."""
        from verispec.fast import quant, qmm
        from verispec.fast.packed import linear_for

        device = self.fc.weight.device
        pack, lin = linear_for(dtype, device)
        eight = quantized and quant.available("q8", dtype, device) is None
        if not eight and lin is F.linear and dtype == self.fc.weight.dtype:
            self._packed = None
            return
        linears = {name: m.weight.detach() for name, m in self.named_modules() if isinstance(m, nn.Linear)}
        groups = {}
        for name in linears:
            stem, _, leaf = name.rpartition(".")
            for group in (("q", "k", "v"), ("gate", "up")):
                if leaf == group[0] and all(f"{stem}.{g}".lstrip(".") in linears for g in group):
                    names = tuple(f"{stem}.{g}".lstrip(".") for g in group)
                    groups[names] = torch.cat([linears[n] for n in names], dim=0)
        self._packed = {}
        for name, w in [*linears.items(), *groups.items()]:
            if eight:
                qw = quant.prepare(w.float(), "q8", dtype)
                # qmm takes float32 activations itself (its 8-bit groups round them): no copy in dtype first
                self._packed[name] = (qw, quant.linear, None if isinstance(qw, qmm.QWeight) else dtype)
            else:
                self._packed[name] = (pack(w.to(dtype)), lin, dtype)

    def lin(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The linear layer `name` (a submodule path) applied to x (the packed copy when there is one)."""
        if self._packed is None:
            return self.get_submodule(name)(x)
        w, linear, dtype = self._packed[name]
        flat = x.reshape(-1, x.shape[-1])
        out = linear(flat if dtype is None else flat.to(dtype), w)
        return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])

    def lins(self, names: tuple[str, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The linear layers `names` applied to the same x: one call on their stacked copy where
        pack_for_inference made one, else each layer."""
        if self._packed is None or names not in self._packed:
            return tuple(self.lin(n, x) for n in names)
        sizes = [self.get_submodule(n).out_features for n in names]
        return self.lin(names, x).split(sizes, dim=-1)


def load_module(target, kind: str, cls, head: str | Path | None = None, device=None, embed: bool = True):
    """The `kind` module at `head` (default: the one shipped for the target), checked against the target,
    in float32, with the target's embedding table attached when `embed` (EAGLE head, block drafter)."""
    from verispec.heads import read_head, resolve_head

    path = resolve_head(target, kind, head)
    config, tensors = read_head(path, kind, target)
    module = cls(config)
    missing, unexpected = module.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()},
                                                 strict=False)
    if missing or unexpected:
        raise HeadMismatch(f"the {kind} head at '{path}' does not fit its config (missing {missing}, unexpected {unexpected})")
    if embed:
        module.attach_embedding(target.model.get_input_embeddings().weight)
    if getattr(module, "context_vocab", False):
        module.attach_lm_rows(target.model.get_output_embeddings().weight)
    return module.to(device or target.device).eval()


class ContextTokens(NamedTuple):
    """Tokens of the context outside a head's static draft vocabulary, appended to it as extra columns.

    A reduced draft vocabulary (FR-Spec, EAGLE-3) keeps the head's LM head small, but the tokens a chat
    answer copies from its prompt (names, numbers, rare words) are often outside it, and where the target is
    surest of its next token such copies are common. Their logits come from the target's own LM-head rows
    (no trained weights, so any token the context holds can be drafted) plus the head's learned offset.
    ids [E] (inference) or [B, E] (training batches; padding repeats a real id and is never visible);
    rows [E, H] / [B, E, H] the target's LM-head rows of those ids; visible [B, Q, E] (training) which
    of them query q has seen, None: all."""

    ids: torch.Tensor
    rows: torch.Tensor
    visible: torch.Tensor | None = None


MAX_CONTEXT_TOKENS = 1024  # a generation's extra columns at most (the first seen are kept)


def context_logits(normed: torch.Tensor, ctx: ContextTokens, bias: torch.Tensor) -> torch.Tensor:
    """The extra columns' logits: normed [..., Q, H] (the head's final-normed state) -> [..., Q, E] in
    float32, -inf where a query has not seen the token."""
    out = (normed.to(ctx.rows.dtype) @ ctx.rows.transpose(-1, -2)).float() + bias.float()
    return out if ctx.visible is None else out.masked_fill(~ctx.visible, float("-inf"))


def batch_context_tokens(tok: torch.Tensor, anchors: torch.Tensor, t2d: torch.Tensor, lm_rows: torch.Tensor,
                         ) -> ContextTokens:
    """Training: per sequence of tok [B, S], its tokens outside the draft vocabulary (t2d[id] < 0), each
    visible to the query anchors t [B, Q] where it occurs at or before t + 1 (the tokens a drafter at
    anchor t has been handed: the committed ones) -> ContextTokens with ids [B, E], rows [B, E, H]."""
    B, S = tok.shape
    pos = torch.arange(S, device=tok.device)
    per_row = []
    for b in range(B):
        outside = t2d[tok[b]] < 0
        ids, inv = tok[b][outside].unique(return_inverse=True)
        first = torch.full((ids.numel(),), S, dtype=torch.long, device=tok.device)
        first.scatter_reduce_(0, inv, pos[outside], reduce="amin")
        per_row.append((ids, first))
    E = max(1, max(ids.numel() for ids, _ in per_row))
    ids = torch.zeros(B, E, dtype=torch.long, device=tok.device)
    first = torch.full((B, E), S + 1, dtype=torch.long, device=tok.device)  # padding: seen after every anchor
    for b, (i, f) in enumerate(per_row):
        ids[b, : i.numel()], first[b, : f.numel()] = i, f
        ids[b, i.numel():] = i[0] if i.numel() else 0
    visible = first[:, None, :] <= anchors[:, :, None] + 1
    return ContextTokens(ids, lm_rows[ids], visible)


def draft_index(ids: torch.Tensor, t2d: torch.Tensor, vd: int, ctx: ContextTokens | None) -> torch.Tensor:
    """Target ids [B, Q, k] -> their draft columns: t2d's (the static vocabulary of vd columns), else
    vd + the context token's index where the query has seen it; -1 where no column drafts them."""
    d = t2d[ids]
    if ctx is None:
        return d
    match = ids[..., None] == ctx.ids[:, None, None, :]
    if ctx.visible is not None:
        match &= ctx.visible[:, :, None, :]
    extra = torch.where(match.any(-1), vd + match.int().argmax(-1), -1)
    return torch.where(d >= 0, d, extra)


def target_ids(columns: torch.Tensor, d2t: torch.Tensor, ctx: ContextTokens | None) -> torch.Tensor:
    """Draft columns [B, Q] -> target ids (training batches)."""
    if ctx is None:
        return d2t[columns]
    Vd = d2t.numel()
    extra = ctx.ids.gather(1, (columns - Vd).clamp_min(0))
    return torch.where(columns < Vd, d2t[columns.clamp_max(Vd - 1)], extra)


class HeadDrafting(Drafter):
    """What the EAGLE, Medusa and block drafters share: the draft vocabulary map, choosing a chain token,
    and scoring tree children (tree.build.Scorer)."""

    can_tree = True
    vocab: int
    d2t: torch.Tensor
    params: SamplingParams
    generator: torch.Generator | None

    def init_context_tokens(self, lm_rows: torch.Tensor | None) -> None:
        """Once, after self.d2t is the static vocabulary: lm_rows, the target's LM-head rows in the drafting
        dtype, lets the drafter append the context's tokens outside that vocabulary (ContextTokens) to
        its columns; None drafts the static vocabulary only."""
        self.static_d2t, self.lm_rows = self.d2t, lm_rows
        self._static_ids = set(self.d2t.tolist()) if lm_rows is not None else set()
        self.forget_context_tokens()

    def forget_context_tokens(self) -> None:
        """A new generation: the columns are the static vocabulary again."""
        self.d2t, self.ctx, self._scanned, self._extra = self.static_d2t, None, 0, {}

    def grow_context_tokens(self, context: list[int]) -> None:
        """Append the tokens of `context` not scanned yet that no column drafts (up to MAX_CONTEXT_TOKENS)."""
        if self.lm_rows is None:
            return
        add = [t for t in dict.fromkeys(context[self._scanned:]) if t not in self._static_ids and t not in self._extra]
        self._scanned = len(context)
        add = add[: MAX_CONTEXT_TOKENS - len(self._extra)]
        if not add:
            return
        self._extra.update(dict.fromkeys(add))
        new = torch.tensor(add, dtype=torch.long, device=self.static_d2t.device)
        rows = self.lm_rows[new]
        self.ctx = ContextTokens(new, rows) if self.ctx is None else ContextTokens(
            torch.cat([self.ctx.ids, new]), torch.cat([self.ctx.rows, rows]))
        self.d2t = torch.cat([self.static_d2t, self.ctx.ids])

    def full_logits(self, lg: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., Vd] -> target-vocabulary logits [..., V] (-inf elsewhere)."""
        out = lg.new_full((*lg.shape[:-1], self.vocab), float("-inf"))
        out[..., self.d2t] = lg
        return out

    def q_of(self, lg: torch.Tensor) -> torch.Tensor:
        """The draft distribution over the target vocabulary, after the target's sampling transform."""
        return logits_to_probs(self.full_logits(lg.float()), self.params)

    def choose(self, lg: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """One chain token: argmax when greedy (no q needed), else a draw from q (and q)."""
        if self.params.greedy:
            return int(self.d2t[int(lg.argmax())]), None
        q = self.q_of(lg)
        return sample(q, self.generator), q

    def ranking(self, lg: torch.Tensor) -> torch.Tensor:
        """Draft logits [n, Vd] -> the probabilities that rank point-mass tree children (a Scorer's)."""
        return lg.float().softmax(-1)


class FeatureQueue:
    """Target features handed over by the engine (observe_features) and not yet turned into the drafter's
    cache entries; the EAGLE and block drafters share it."""

    device: torch.device
    params: SamplingParams
    generator: torch.Generator | None

    def clear_features(self) -> None:
        self.features: list[torch.Tensor] = []  # not yet turned into entries
        self.n_features = 0                     # received so far (positions 0..n_features-1)

    def begin(self, prompt: list[int], params: SamplingParams, generator: torch.Generator | None) -> None:
        self.reset()
        self.params, self.generator = params, generator

    def observe_features(self, features: torch.Tensor) -> None:
        """Target features [m, F] of the next m committed positions (prefill, then each accepted path)."""
        self.features.append(features.to(self.device))
        self.n_features += int(features.shape[0])

    def take_features(self) -> torch.Tensor | None:
        """The queued features as one [m, F] tensor (the queue empties), or None when there are none."""
        if not self.features:
            return None
        feats = torch.cat(self.features, dim=0)
        self.features = []
        return feats
