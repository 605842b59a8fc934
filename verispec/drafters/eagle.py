"""EAGLE-style drafter: a decoder layer (or a few) that drafts from the target's own hidden features.

The head (after EAGLE-3, Li et al. 2025): the target's hidden states from a low, a middle and a high
layer are concatenated and projected (fc) to one feature g_t per position t; the decoder layer reads
inp([norm(embed(x_{t+1})), norm(g_t)]) (the NEXT token's embedding, taken from the target's frozen
embedding table) and its output h_t gives, through a norm and an LM head over a reduced draft
vocabulary (the most frequent tokens of the training data, FR-Spec / EAGLE-3), the distribution of
x_{t+2}. Drafting further, h_t itself stands in for the target feature of the drafted position.
With `num_layers` > 1, plain decoder layers (norm, attention, MLP, each on the residual) follow the
first one and h_t is the last one's output; every layer keeps its own keys and values.

Two layouts of that layer: "verispec" (the default, the shipped heads) projects the concatenation to H
with `inp` and feeds ln1 of it to attention, its residual the projection; "eagle3" is EAGLE-3's own
first layer (attention reads the 2H concatenation, residual g_t), the form vLLM and SGLang load
(heads/interop.py exports and imports it).

Its KV cache (one per layer) keeps committed positions only: the entry of position t needs the target's feature of t
and the token x_{t+1}, so after each verification the engine hands over the features of the accepted
positions (Engine: drafter.observe_features) and the next proposal first appends their entries (one
forward), then drafts in scratch slots past them, which the next proposal overwrites. Trees: the
drafter is a tree.build Scorer (the builder picks nodes and children, static or dynamic); each depth
of the tree is drafted in one forward under a tree mask.

Sampling: a chain's tokens are drawn from the head's distribution q (the same temperature/top-k/top-p
transform as the target, zero outside the draft vocabulary), and q goes with the proposal, so the
speculative-sampling rule keeps the target's distribution exactly.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from verispec.drafters.head_parts import (DecoderLayer, FeatureQueue, HeadDrafting, PackedLinears, RMSNorm,
                                          default_feature_layers, load_module, rotary, rotate)
from verispec.errors import HeadMismatch
from verispec.fast import native, quant
from verispec.tree import Candidate, ancestors, build_tree, to_proposal
from verispec.types import Proposal, SamplingParams, StepResult


LAYOUTS = ("verispec", "eagle3")


class EagleHead(PackedLinears, nn.Module):
    """The trainable head. `config` is the head's config.json (see heads/__init__.py)."""

    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        H, Ht = int(config["hidden_size"]), int(config["target"]["hidden_size"])
        self.n_heads, self.n_kv, self.head_dim = int(config["num_heads"]), int(config["num_kv_heads"]), int(config["head_dim"])
        self.feature_layers = [int(i) for i in config["feature_layers"]]
        inter, vd = int(config["intermediate_size"]), int(config["draft_vocab_size"])
        eps = float(config.get("rms_norm_eps", 1e-5))
        self.layout = config.get("layout", "verispec")
        if self.layout not in LAYOUTS:
            raise HeadMismatch(f"unknown eagle head layout {self.layout!r}; use one of {', '.join(LAYOUTS)}")
        if self.layout == "eagle3" and H != Ht:
            raise HeadMismatch(f"an eagle3-layout head reads the target's embedding beside its own hidden state, so its "
                               f"hidden_size must be the target's ({Ht}), not {H}")
        self.norm_before_residual = bool(config.get("norm_before_residual", False))
        self.hidden = H
        self.fc = nn.Linear(len(self.feature_layers) * Ht, H, bias=False)
        self.norm_e, self.norm_h = RMSNorm(Ht, eps), RMSNorm(H, eps)
        width = H
        if self.layout == "verispec":
            self.inp = nn.Linear(Ht + H, H, bias=False)
            self.ln1 = RMSNorm(H, eps)
        else:
            width = Ht + H  # EAGLE-3: attention reads [norm(embedding), norm(hidden)] itself
        self.ln2, self.norm = RMSNorm(H, eps), RMSNorm(H, eps)
        self.q = nn.Linear(width, self.n_heads * self.head_dim, bias=False)
        self.k = nn.Linear(width, self.n_kv * self.head_dim, bias=False)
        self.v = nn.Linear(width, self.n_kv * self.head_dim, bias=False)
        self.o = nn.Linear(self.n_heads * self.head_dim, H, bias=False)
        self.gate = nn.Linear(H, inter, bias=False)
        self.up = nn.Linear(H, inter, bias=False)
        self.down = nn.Linear(inter, H, bias=False)
        self.num_layers = int(config.get("num_layers", 1))
        if self.num_layers < 1:
            raise HeadMismatch(f"an eagle head has at least one layer, not {self.num_layers}")
        self.layers = nn.ModuleList(DecoderLayer(H, self.n_heads, self.n_kv, self.head_dim, inter, eps)
                                    for _ in range(self.num_layers - 1))  # the layers after the first
        self.lm_head = nn.Linear(H, vd, bias=False)
        self.register_buffer("d2t", torch.arange(vd, dtype=torch.long))
        theta = float(config.get("rope_theta", 10000.0))
        inv = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.embed: torch.Tensor | None = None  # the target's embedding table (frozen, not saved)

    @staticmethod
    def make_config(target, draft_vocab_size: int, feature_layers: list[int] | None = None,
                    intermediate_size: int | None = None, layout: str = "verispec", num_layers: int = 1) -> dict:
        from verispec.heads import target_identity

        cfg = target.model.config
        H = int(cfg.hidden_size)
        heads = int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or H // heads)
        rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        return {"kind": "eagle", "target": target_identity(target),
                "feature_layers": feature_layers or default_feature_layers(int(cfg.num_hidden_layers)),
                "hidden_size": H, "num_heads": heads, "num_kv_heads": int(cfg.num_key_value_heads), "head_dim": head_dim,
                "intermediate_size": int(intermediate_size or cfg.intermediate_size), "draft_vocab_size": int(draft_vocab_size),
                "rope_theta": float(rope or 10000.0), "layout": layout, "num_layers": int(num_layers)}

    def attach_embedding(self, weight: torch.Tensor) -> None:
        self.embed = weight.detach()

    # the pieces shared by inference (drafter below) and training (train/loops.py)
    def project(self, features: torch.Tensor) -> torch.Tensor:
        return self.lin("fc", features.to(self.fc.weight.dtype))

    def inputs(self, ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Token ids [...] and hidden states g [..., H] -> the layer input x that qkv and finish read:
        verispec layout: inp([norm_e(e), norm_h(g)]) [..., H]; eagle3 layout: [norm_e(e), norm_h(g), r]
        [..., 3H], r the residual (g, or norm_h(g) with norm_before_residual)."""
        e = self.norm_e(F.embedding(ids, self.embed).to(g.dtype))
        gn = self.norm_h(g)
        if self.layout == "eagle3":
            return torch.cat([e, gn, gn if self.norm_before_residual else g], dim=-1)
        return self.lin("inp", torch.cat([e, gn], dim=-1))

    def _names(self, layer: int) -> str:
        return "" if layer == 0 else f"layers.{layer - 1}."

    def qkv(self, x: torch.Tensor, pos: torch.Tensor, layer: int = 0):
        """x [..., T, W] (layer 0: from inputs; later layers: the layer before's output), pos [..., T] ->
        q [..., nh, T, hd], k, v [..., nkv, T, hd] (rotated)."""
        if layer:
            h = self.layers[layer - 1].ln1(x)
        else:
            h = x[..., : -self.hidden] if self.layout == "eagle3" else self.ln1(x)
        shape = x.shape[:-1]
        p = self._names(layer)
        q, k, v = self.lins((p + "q", p + "k", p + "v"), h)
        q = q.reshape(*shape, self.n_heads, self.head_dim).transpose(-3, -2)
        k = k.reshape(*shape, self.n_kv, self.head_dim).transpose(-3, -2)
        v = v.reshape(*shape, self.n_kv, self.head_dim).transpose(-3, -2)
        tables = rotary(pos, self.inv_freq, q.dtype)
        return rotate(q, tables), rotate(k, tables), v

    def finish(self, x: torch.Tensor, attn: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """x [..., T, W] (the layer's input), attn [..., nh, T, hd] -> the layer's output h [..., T, H]."""
        r = x[..., -self.hidden:] if self.layout == "eagle3" and not layer else x
        p = self._names(layer)
        x = r + self.lin(p + "o", attn.transpose(-3, -2).reshape(*x.shape[:-1], -1))
        gate, up = self.lins((p + "gate", p + "up"), (self.layers[layer - 1].ln2 if layer else self.ln2)(x))
        return x + self.lin(p + "down", F.silu(gate) * up)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """-> logits over the draft vocabulary (index i is target token d2t[i])."""
        return self.lin("lm_head", self.norm(h)).float()


def load_eagle_head(target, head: str | Path | None = None, device=None) -> EagleHead:
    """The EAGLE head at `head` (default: the one shipped for the target), checked against the target."""
    return load_module(target, "eagle", EagleHead, head, device)


class EagleDrafter(FeatureQueue, HeadDrafting):
    name = "eagle"

    def __init__(self, head: EagleHead, target_vocab_size: int, weights_dtype: torch.dtype | None = None,
                 quantized: bool = False, native: bool = True):
        """weights_dtype: draft with packed copies of the head's weights in this dtype (the target's,
        see EagleHead.pack_for_inference), 8-bit ones where `quantized` (the target runs quantized
        weights); None drafts with the parameters as they are. native False: the Python operations run
        even where the native step could (the reference it is tested against; dev/head_cost.py times both)."""
        self.head = head.eval()
        if weights_dtype is not None:
            head.pack_for_inference(weights_dtype, quantized)
        self.vocab = int(target_vocab_size)
        self.feature_layers = list(head.feature_layers)
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.d2t = head.d2t.to(self.device)
        self.params, self.generator = SamplingParams(), None
        self.prune = True  # dynamic trees: stop expanding once no deeper node can be kept (same tree, less work)
        self._native: tuple | None = None if native else (False,)  # _native_args, once built
        self.K = torch.zeros(head.num_layers, head.n_kv, 0, head.head_dim, dtype=self.dtype, device=self.device)
        self.V = self.K.clone()
        self.reset()

    @classmethod
    def for_target(cls, target, head: str | Path | None = None, native: bool = True) -> "EagleDrafter":
        return cls(load_eagle_head(target, head), target.vocab_size, weights_dtype=target.dtype,
                   quantized=quant.target_format(target) != "bf16", native=native)

    def reset(self) -> None:
        self.n = 0                       # committed entries in the head's cache (positions 0..n-1)
        self.clear_features()
        self.h_last: torch.Tensor | None = None  # head output at position n-1

    def observe(self, result: StepResult) -> None:
        pass  # drafted entries live in scratch slots past the committed ones; the next sync overwrites them

    # ---- the head's cache

    def _ensure(self, slots: int) -> None:
        if slots > self.K.shape[2]:
            size = max(slots, 2 * self.K.shape[2], 256)
            K = self.K.new_zeros(*self.K.shape[:2], size, self.K.shape[3])
            V = torch.zeros_like(K)
            K[:, :, : self.K.shape[2]] = self.K
            V[:, :, : self.V.shape[2]] = self.V
            self.K, self.V = K, V

    def _native_args(self) -> tuple | None:
        """The head as native.eagle_run takes it (weights, norms, shapes), or None where the Python
        operations run (no native extension, another device, a linear it does not cover). Built once: the
        packed copies do not change while the drafter drafts."""
        if self._native is None:
            self._native = (False,)
            head = self.head
            if native.module() is not None and self.device.type == "cpu" and head.embed is not None:
                norms = [head.norm_e.weight, head.norm_h.weight]
                for layer in range(head.num_layers):
                    first = head.layers[layer - 1] if layer else head
                    ln1 = head.norm_e if layer == 0 and head.layout == "eagle3" else first.ln1  # eagle3: none (unused)
                    norms += [ln1.weight, first.ln2.weight]
                lins = native.head_linears(head, ["inp"] if head.layout == "verispec" else [],
                                           [head._names(layer) for layer in range(head.num_layers)], [])
                if lins is not None:
                    self._native = (True, norms, *lins, head.inv_freq, head.layout == "eagle3", head.norm_before_residual,
                                    head.n_heads, head.n_kv, head.head_dim, head.gate.out_features, head.norm_e.eps)
        return self._native[1:] if self._native[0] else None

    def _run(self, ids: list[int], g: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Entries for tokens `ids` with features g [m, H] at positions pos into `slots`; mask [m, L]
        says which cache slots each attends to (its own included) -> head outputs h [m, H]. One native
        call where the extension covers the head (native.eagle_run: the same operations from C++, the
        same bits), else the operations below."""
        head = self.head
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
        args = self._native_args()
        if args is not None:
            return native.module().eagle_run(ids_t, g, pos, slots, mask, self.K, self.V, head.embed, *args)
        x = head.inputs(ids_t, g)
        L = mask.shape[1]
        for layer in range(head.num_layers):
            q, k, v = head.qkv(x, pos, layer)
            self.K[layer][:, slots] = k
            self.V[layer][:, slots] = v
            attn = F.scaled_dot_product_attention(q[None], self.K[layer, None, :, :L], self.V[layer, None, :, :L],
                                                  attn_mask=mask[None, None], enable_gqa=head.n_heads != head.n_kv)[0]
            x = head.finish(x, attn, layer)
        return x

    @torch.inference_mode()
    def sync(self, context: list[int]) -> torch.Tensor | None:
        """Append the committed entries the new features allow -> the head output at the last one
        (position len(context) - 2, whose logits give the first draft token), or None without features."""
        feats = self.take_features()
        if feats is not None:
            start, end = self.n, self.n + int(feats.shape[0])
            if end > len(context) - 1:
                raise ValueError(f"the drafter holds features for {end} positions but the context has {len(context)} tokens")
            self._ensure(end + 64)
            pos = torch.arange(start, end, device=self.device)
            mask = torch.arange(end, device=self.device)[None, :] <= pos[:, None]
            h = self._run(context[start + 1: end + 1], self.head.project(feats), pos, pos, mask)
            self.n, self.h_last = end, h[-1]
        return self.h_last if self.n == len(context) - 1 else None

    def _expand(self, tokens: list[int], h_src: torch.Tensor, depth: int, anc_slots: list[list[int]]) -> torch.Tensor:
        """Scratch entries for drafted nodes at `depth` (1 = the first draft token) -> their outputs [m, H].
        anc_slots[r]: the scratch slots of node r's drafted ancestors."""
        m = len(tokens)
        first = self.scratch
        self._ensure(first + m + 64)
        slots = torch.arange(first, first + m, device=self.device)
        mask = torch.zeros(m, first + m, dtype=torch.bool, device=self.device)
        mask[:, : self.n] = True
        rows = [r for r in range(m) for _ in anc_slots[r]] + list(range(m))
        cols = [j for a in anc_slots for j in a] + list(range(first, first + m))
        mask[rows, cols] = True  # ancestors and itself, in one indexed write
        pos = torch.full((m,), self.n - 1 + depth, device=self.device)
        self.scratch += m
        return self._run(tokens, h_src, pos, slots, mask)

    # ---- proposals

    @torch.inference_mode()
    def propose(self, context: list[int], k: int) -> Proposal | None:
        h = self.sync(context)
        if h is None or k < 1:
            return None
        self.scratch = self.n
        tokens, probs, slots = [], [], []
        for depth in range(1, k + 1):
            x, q = self.choose(self.head.logits(h))
            tokens.append(x)
            probs.append(q)
            if depth < k:
                h = self._expand([x], h[None], depth, [list(slots)])[0]
                slots.append(self.scratch - 1)
        draft_probs = None if self.params.greedy else torch.stack(probs)
        return Proposal(tokens=torch.tensor(tokens, dtype=torch.long), draft_probs=draft_probs)

    @torch.inference_mode()
    def propose_tree(self, context: list[int], shape) -> Proposal | None:
        root = self.sync(context)
        if root is None:
            return None
        self.scratch = self.n
        self._out: dict[int, torch.Tensor] = {-1: root}  # head output of each fed node (-1: the pending root)
        self._slot: dict[int, int] = {}                    # its scratch slot
        cands, keep = build_tree(self, shape, not self.params.greedy, self.generator, prune=self.prune)
        return to_proposal(cands, keep, vocab=self.vocab) if keep else None

    def feed(self, cands: list[Candidate], nodes: list[int]) -> None:
        """Scratch entries for tree nodes of one depth, from their parents' head outputs."""
        first = self.scratch
        h = self._expand([cands[c].token for c in nodes], torch.stack([self._out[cands[c].parent] for c in nodes]),
                         cands[nodes[0]].depth, [[self._slot[a] for a in ancestors(cands, c)] for c in nodes])
        for r, c in enumerate(nodes):
            self._slot[c], self._out[c] = first + r, h[r]

    def child_logits(self, cands: list[Candidate], nodes: list[int]) -> torch.Tensor:
        return self.head.logits(torch.stack([self._out[c] for c in nodes]))
