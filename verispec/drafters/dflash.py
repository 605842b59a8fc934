"""The DFlash drafter: a few transformer layers that propose a whole block in ONE forward.

After DFlash (Chen, Liang, Liu 2026, "DFlash: Block Diffusion for Flash Speculative Decoding",
arXiv 2602.06036). The target's hidden states from a low, a middle and a high layer (the layers the
EAGLE head reads, handed over by the engine the same way: Engine -> drafter.observe_features) are
concatenated and fused by a projection and a norm into one context feature c_t per committed position
t. Every drafter layer injects the context as extra keys and values: its own k/v projections applied to
c_0..c_{n-1} (cached, one entry per committed position, computed once), beside the keys and values of
the block itself. The block is [the pending token, MASK slots 1..B-1] at positions n..n+B-1 (every row reads the pending token and
c_{n-1} through an input projection, as EAGLE's input does; the slots add their own embedding) (the pending
token is the last token of the context, not yet in the target's cache), with attention bidirectional
inside the block and over the whole committed prefix from position 0; MASK slot i's output gives,
through a norm and an LM head, the distribution of the token at its own position. One forward over B
rows drafts B-1 tokens, whatever the draft length.

Embedding: the target's own (frozen, not saved). LM head: a reduced draft vocabulary whose rows start
as the target's LM-head rows and its final norm (as the EAGLE head's): the full 49k-row LM head over B
rows would cost more per block than the drafter's layers.

Verification: a chain is each position's argmax (greedy) or a draw from each position's q (sampling;
q goes with the proposal), and a tree takes each position's top-k tokens as the children of every node
at that depth (drafters/head_parts.PositionDrafting, shared with Medusa); the project's acceptance rules
apply unchanged, so the output is the target's exactly.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from verispec.drafters.head_parts import (DecoderLayer, FeatureQueue, PackedLinears, PositionDrafting, RMSNorm,
                                          default_feature_layers, load_module, rotary, rotate)
from verispec.fast import native, quant
from verispec.types import SamplingParams, StepResult


class DFlashModel(PackedLinears, nn.Module):
    """The trainable drafter. `config` is its config.json (see heads/__init__.py)."""

    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        H = int(config["target"]["hidden_size"])
        self.hidden = H
        self.n_heads, self.n_kv, self.head_dim = int(config["num_heads"]), int(config["num_kv_heads"]), int(config["head_dim"])
        self.block_size = int(config["block_size"])
        self.feature_layers = [int(i) for i in config["feature_layers"]]
        inter, vd = int(config["intermediate_size"]), int(config["draft_vocab_size"])
        self.fc = nn.Linear(len(self.feature_layers) * H, H, bias=False)
        self.norm_c = RMSNorm(H)
        self.norm_e = RMSNorm(H)
        self.inp = nn.Linear(2 * H, H, bias=False)
        self.mask_embed = nn.Parameter(torch.zeros(self.block_size - 1, H))  # one per slot: slots differ from the start
        self.layers = nn.ModuleList(DecoderLayer(H, self.n_heads, self.n_kv, self.head_dim, inter)
                                    for _ in range(int(config["num_layers"])))
        self.norm = RMSNorm(H)
        self.lm_head = nn.Linear(H, vd, bias=False)
        self.register_buffer("d2t", torch.arange(vd, dtype=torch.long))
        theta = float(config.get("rope_theta", 10000.0))
        inv = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.embed: torch.Tensor | None = None  # the target's embedding table (frozen, not saved)
        for layer in self.layers:  # every layer starts as the identity, so the first logits are flat
            layer.start_as_identity()  # (loss ~ log Vd), not confident noise

    @staticmethod
    def make_config(target, draft_vocab_size: int, block_size: int = 8, num_layers: int = 2,
                    feature_layers: list[int] | None = None, intermediate_size: int | None = None) -> dict:
        from verispec.heads import target_identity

        cfg = target.model.config
        H = int(cfg.hidden_size)
        heads = int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or H // heads)
        rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        return {"kind": "dflash", "target": target_identity(target), "block_size": int(block_size),
                "num_layers": int(num_layers),
                "feature_layers": feature_layers or default_feature_layers(int(cfg.num_hidden_layers)),
                "num_heads": heads, "num_kv_heads": int(cfg.num_key_value_heads), "head_dim": head_dim,
                "intermediate_size": int(intermediate_size or cfg.intermediate_size),
                "draft_vocab_size": int(draft_vocab_size), "rope_theta": float(rope or 10000.0)}

    def attach_embedding(self, weight: torch.Tensor) -> None:
        self.embed = weight.detach()

    # ---- the pieces shared by inference (DFlashDrafter) and training (train/loops.py)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., T, len(layers) * H] -> fused context features c [..., T, H]."""
        return self.norm_c(self.lin("fc", features.to(self.fc.weight.dtype)))

    def context_kv(self, c: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """c [..., T, H] at positions pos [..., T] -> per layer (k, v) [..., nkv, T, hd] (k rotated)."""
        out, tables = [], None  # the same positions in every layer; in the projections' dtype (autocast)
        for i, layer in enumerate(self.layers):
            k = self.lin(f"layers.{i}.k", c).unflatten(-1, (self.n_kv, self.head_dim)).transpose(-3, -2)
            v = self.lin(f"layers.{i}.v", c).unflatten(-1, (self.n_kv, self.head_dim)).transpose(-3, -2)
            tables = tables or rotary(pos, self.inv_freq, k.dtype)
            out.append((rotate(k, tables), v))
        return out

    def block_inputs(self, pending: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """pending [...] token ids, last [..., H] the context feature of the last committed position ->
        block inputs [..., B, H]: every row starts from inp([norm(embed(pending)); last]) (EAGLE's input:
        the pending token with the latest feature), the MASK slots 1..B-1 add their own embedding. Giving
        every row both directly spares the slots learning to find them by attention first, which a
        CPU-sized training run cannot wait for (the pending token's embedding alone in row 0, as in
        DFlash, learnt next to nothing in a short training run: docs/dflash.md)."""
        e = self.norm_e(F.embedding(pending, self.embed).to(self.mask_embed.dtype))
        fused = self.lin("inp", torch.cat([e, last.to(e.dtype)], dim=-1))
        slots = torch.cat([self.mask_embed.new_zeros(1, self.hidden), self.mask_embed], dim=0)
        return fused[..., None, :] + slots

    def blocks(self, x: torch.Tensor, pos: torch.Tensor, ctx: list[tuple[torch.Tensor, torch.Tensor]],
               mask: torch.Tensor | None) -> torch.Tensor:
        """x [b, R, H] block rows at positions pos [b, R]; ctx per layer (k, v) [b, nkv, S, hd]; mask
        [b, 1, R, S + R] (True = visible) or None (all visible) -> logits [b, R, Vd] over the draft vocabulary."""
        tables = None  # the same positions in every layer; in the projections' dtype (autocast)
        for i, layer in enumerate(self.layers):
            h = layer.ln1(x)
            q, k, v = self.lins((f"layers.{i}.q", f"layers.{i}.k", f"layers.{i}.v"), h)
            q = q.unflatten(-1, (self.n_heads, self.head_dim)).transpose(-3, -2)
            k = k.unflatten(-1, (self.n_kv, self.head_dim)).transpose(-3, -2)
            v = v.unflatten(-1, (self.n_kv, self.head_dim)).transpose(-3, -2)
            tables = tables or rotary(pos, self.inv_freq, q.dtype)
            q, k = rotate(q, tables), rotate(k, tables)
            K = torch.cat([ctx[i][0].to(k.dtype), k], dim=-2)
            V = torch.cat([ctx[i][1].to(v.dtype), v], dim=-2)
            rep = self.n_heads // self.n_kv
            attn = F.scaled_dot_product_attention(q, K, V, enable_gqa=rep > 1,
                                                  attn_mask=mask)
            x = x + self.lin(f"layers.{i}.o", attn.transpose(-3, -2).flatten(-2))
            gate, up = self.lins((f"layers.{i}.gate", f"layers.{i}.up"), layer.ln2(x))
            x = x + self.lin(f"layers.{i}.down", F.silu(gate) * up)
        return self.lin("lm_head", self.norm(x)).float()


def load_dflash_model(target, head: str | Path | None = None, device=None) -> DFlashModel:
    """The DFlash drafter at `head` (default: the one shipped for the target), checked against the target."""
    return load_module(target, "dflash", DFlashModel, head, device)


class DFlashDrafter(FeatureQueue, PositionDrafting):
    """The drafter: a cache of the context keys/values per layer for the committed positions, and one
    block forward per proposal."""

    name = "dflash"

    def __init__(self, model: DFlashModel, target_vocab_size: int, weights_dtype: torch.dtype | None = None,
                 quantized: bool = False, native: bool = True):
        """weights_dtype, quantized, native: as EagleDrafter's (PackedLinears.pack_for_inference)."""
        self.model = model.eval()
        if weights_dtype is not None:
            model.pack_for_inference(weights_dtype, quantized)
        self.vocab = int(target_vocab_size)
        self.feature_layers = list(model.feature_layers)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.d2t = model.d2t.to(self.device)
        self.params, self.generator = SamplingParams(), None
        self._native: tuple | None = None if native else (False,)  # _native_args, once built
        self.reset()

    @classmethod
    def for_target(cls, target, head: str | Path | None = None, native: bool = True) -> "DFlashDrafter":
        return cls(load_dflash_model(target, head), target.vocab_size, weights_dtype=target.dtype,
                   quantized=quant.target_format(target) != "bf16", native=native)

    @property
    def positions(self) -> int:
        return self.model.block_size - 1

    def reset(self) -> None:
        m = self.model
        self.n = 0  # committed positions whose context entries are cached
        self.K = [torch.zeros(1, m.n_kv, 0, m.head_dim, dtype=self.dtype, device=self.device) for _ in m.layers]
        self.V = [k.clone() for k in self.K]
        self.clear_features()
        self.last: torch.Tensor | None = None  # context feature of position n - 1

    def observe(self, result: StepResult) -> None:
        pass  # the block is not cached: the next proposal starts from the committed context alone

    def _grow(self, need: int) -> None:
        have = self.K[0].shape[2]
        if need <= have:
            return
        size = max(need, 2 * have, 256)
        for store in (self.K, self.V):
            for i, t in enumerate(store):
                new = t.new_zeros(1, t.shape[1], size, t.shape[3])
                new[:, :, :have] = t
                store[i] = new

    def _native_args(self) -> tuple | None:
        """The drafter's layers as native.dflash_blocks takes them, or None where the Python operations run
        (as EagleDrafter._native_args)."""
        if self._native is None:
            self._native = (False,)
            m = self.model
            norms = [w for layer in m.layers for w in (layer.ln1.weight, layer.ln2.weight)] + [m.norm.weight]
            eps = {n.eps for n in m.modules() if isinstance(n, RMSNorm)}
            if native.module() is not None and self.device.type == "cpu" and len(eps) == 1:
                lins = native.head_linears(m, [], [f"layers.{i}." for i in range(len(m.layers))], ["lm_head"])
                if lins is not None:
                    self._native = (True, norms, *lins, m.inv_freq, m.n_heads, m.n_kv, m.head_dim,
                                    m.layers[0].gate.out_features, eps.pop())
        return self._native[1:] if self._native[0] else None

    @torch.inference_mode()
    def block_logits(self, context: list[int]) -> torch.Tensor | None:
        """Append the context entries of the new features, then one block forward -> logits [B-1, Vd] of
        the B-1 tokens after the pending one (context[-1]), or None when the features do not cover the
        context (the drafter then proposes nothing)."""
        feats = self.take_features()
        if feats is not None:
            start, end = self.n, self.n + int(feats.shape[0])
            self._grow(end)
            pos = torch.arange(start, end, device=self.device)
            c = self.model.context(feats[None])
            for i, (k, v) in enumerate(self.model.context_kv(c, pos[None])):
                self.K[i][:, :, start:end], self.V[i][:, :, start:end] = k, v
            self.last = c[:, -1]
            self.n = end
        if self.n != len(context) - 1 or self.n == 0:
            return None
        m = self.model
        x = m.block_inputs(torch.tensor([context[-1]], device=self.device), self.last)
        pos = torch.arange(self.n, self.n + m.block_size, device=self.device)[None]
        ctx = [(k[:, :, : self.n], v[:, :, : self.n]) for k, v in zip(self.K, self.V)]
        args = self._native_args()
        if args is not None:  # m.blocks's operations from C++ (native.dflash_blocks), the same bits
            return native.module().dflash_blocks(x, pos, [k for k, _ in ctx], [v for _, v in ctx], *args)[0, 1:]
        return m.blocks(x, pos, ctx, None)[0, 1:]


def block_logits_for_anchors(model: DFlashModel, tok: torch.Tensor, feats: torch.Tensor,
                             anchors: torch.Tensor) -> torch.Tensor:
    """The training (and teacher-forced evaluation) forward: tok [b, S], feats [b, S, F] (the model's
    feature columns), anchors [b, Q] (EAGLE's numbering: at anchor t the committed prefix is 0..t and
    the pending token is x_{t+1}) -> logits [b, Q, B-1, Vd]; slot i (1-based) predicts x_{t+1+i}, i.e.
    the target's distribution at position t + i (train/loops.shifted_labels(batch, i)).

    Every block sees the context entries of positions 0..t (the whole prefix, as the drafter's cache
    holds at inference) and its own B rows; anchors whose pending token lies past S read a clamped
    token (their labels are masked)."""
    b, S = tok.shape
    Q, B = anchors.shape[1], model.block_size
    dev = tok.device
    c = model.context(feats)
    ctx = model.context_kv(c, torch.arange(S, device=dev).expand(b, S))
    pending = tok.gather(1, (anchors + 1).clamp_max(S - 1))
    x = model.block_inputs(pending, c.gather(1, anchors[:, :, None].expand(b, Q, c.shape[-1]))).flatten(1, 2)  # [b, Q*B, H]
    pos = ((anchors + 1)[:, :, None] + torch.arange(B, device=dev)).flatten(1)
    see_ctx = torch.arange(S, device=dev)[None, None, :] <= anchors.repeat_interleave(B, 1)[:, :, None]  # [b, QB, S]
    blk = torch.arange(Q, device=dev).repeat_interleave(B)
    see_blk = (blk[:, None] == blk[None, :]).expand(b, Q * B, Q * B)
    mask = torch.cat([see_ctx, see_blk], dim=-1)[:, None]
    return model.blocks(x, pos, ctx, mask).unflatten(1, (Q, B))[:, :, 1:]


def position_weights(block_size: int, gamma: float | None = None) -> list[float]:
    """Loss weight of block slot i = 1..B-1: exp(-(i-1)/gamma), DFlash's decay that favours the early
    positions (an early miss ends the accepted run, so later positions matter less); gamma defaults to
    (B-1)/2."""
    gamma = gamma or max(1.0, (block_size - 1) / 2)
    return [math.exp(-(i - 1) / gamma) for i in range(1, block_size)]
