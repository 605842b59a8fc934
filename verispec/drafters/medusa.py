"""Medusa heads: K residual blocks on the target's last hidden state, head k predicting the token k
steps past the next one (Cai et al. 2024), verified with a static tree.

The target's final normed hidden state h_t at the last committed position t (its logits gave the
pending token x_{t+1}) goes through head k's block, h + SiLU(W_k h + b_k), and an LM head over the
reduced draft vocabulary (shared by the heads, initialised from the target's LM head rows; the head
stores which target ids its rows are) to give the distribution of x_{t+1+k}. A proposal reads only the
engine's features (Engine: drafter.observe_features); it needs no cache of its own.

Trees: the node at path (r_1, ..., r_d) of a static tree (tree.StaticTree, Medusa's format) is the
r_d-th best token of head d, for every parent alike (the heads do not see the drafted prefix): the
drafter is a tree.build Scorer whose children at depth d are head d's, whatever the parent (sampled
static trees draw them without replacement from q_d; dynamic trees rank them by the product of their
heads' probabilities). A chain is head 1..k's
argmax (greedy) or draws from q_1..q_k with q going with the proposal (speculative sampling).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from verispec.drafters.head_parts import PackedLinears, PositionDrafting, load_module
from verispec.fast import quant
from verispec.types import SamplingParams, StepResult


class MedusaHeads(PackedLinears, nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        H = int(config["target"]["hidden_size"])
        self.num_heads = int(config["num_heads"])
        self.feature_layers = [int(i) for i in config["feature_layers"]]
        self.blocks = nn.ModuleList(nn.Linear(H, H) for _ in range(self.num_heads))
        self.lm_head = nn.Linear(H, int(config["draft_vocab_size"]), bias=False)
        self.register_buffer("d2t", torch.arange(int(config["draft_vocab_size"]), dtype=torch.long))
        for block in self.blocks:  # a zero block makes head k start as the target's own next-token head
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    @staticmethod
    def make_config(target, draft_vocab_size: int, num_heads: int = 4) -> dict:
        from verispec.heads import target_identity

        L = int(target.model.config.num_hidden_layers)
        return {"kind": "medusa", "target": target_identity(target), "feature_layers": [L],
                "num_heads": int(num_heads), "draft_vocab_size": int(draft_vocab_size)}

    def init_lm_head(self, target_lm_weight: torch.Tensor) -> None:
        with torch.no_grad():
            self.lm_head.weight.copy_(target_lm_weight[self.d2t].float())

    def stacks(self) -> tuple[tuple[str, ...], ...]:
        return (tuple(str(k) for k in range(self.num_heads)),)  # every block reads h: one stacked copy

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] (the target's final normed hidden state) -> logits [..., K, Vd] (head k predicts
        the token k + 1 positions after h's)."""
        h = h.to(self.lm_head.weight.dtype)
        outs = [h + F.silu(y) for y in self.lins(tuple(f"blocks.{k}" for k in range(self.num_heads)), h)]
        return self.lin("lm_head", torch.stack(outs, dim=-2)).float()


def load_medusa_heads(target, head: str | Path | None = None, device=None) -> MedusaHeads:
    return load_module(target, "medusa", MedusaHeads, head, device, embed=False)


class MedusaDrafter(PositionDrafting):
    name = "medusa"

    def __init__(self, heads: MedusaHeads, target_vocab_size: int, weights_dtype: torch.dtype | None = None,
                 quantized: bool = False):
        """weights_dtype, quantized: as EagleDrafter's (PackedLinears.pack_for_inference)."""
        self.heads = heads.eval()
        if weights_dtype is not None:
            heads.pack_for_inference(weights_dtype, quantized)
        self.vocab = int(target_vocab_size)
        self.feature_layers = list(heads.feature_layers)
        self.device = next(heads.parameters()).device
        self.d2t = heads.d2t.to(self.device)
        self.params, self.generator = SamplingParams(), None
        self.last: torch.Tensor | None = None
        self.n_features = 0

    @classmethod
    def for_target(cls, target, head: str | Path | None = None) -> "MedusaDrafter":
        return cls(load_medusa_heads(target, head), target.vocab_size, weights_dtype=target.dtype,
                   quantized=quant.target_format(target) != "bf16")

    def begin(self, prompt: list[int], params: SamplingParams, generator: torch.Generator | None) -> None:
        self.params, self.generator = params, generator
        self.last, self.n_features = None, 0

    def observe_features(self, features: torch.Tensor) -> None:
        if features.shape[0]:
            self.last = features[-1].to(self.device)
            self.n_features += int(features.shape[0])

    def observe(self, result: StepResult) -> None:
        pass

    @torch.inference_mode()
    def block_logits(self, context: list[int]) -> torch.Tensor | None:
        if self.last is None or self.n_features != len(context) - 1:
            return None
        return self.heads(self.last)  # [K, Vd]
