"""The transformers backend: a causal LM with a DynamicCache behind the Runner contract (base.py).

Tree verification goes through the model's standard inputs: explicit position ids (context length +
depth) and a custom 4-D additive float mask [1, 1, n, length + n], which transformers passes through
unchanged (masking_utils._preprocess_mask_arguments returns a 4-D mask as-is). Models that mix layer
types (Gemma 3: sliding-window and full-attention layers) take a dict keyed by layer type instead,
the same mapping their forward builds for itself; we build the sliding-window variant ourselves from
positions (a key is visible when query position - key position < window, transformers'
sliding_window_overlay), since the KV cache keeps every position in every layer: it is built without
a config, so every layer (sliding-window layers of Gemma 3 included) keeps all its entries and position
i of the sequence is slot i of every layer. That makes rollback a slice and a tree path's commit an
index copy, for every family alike.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from verispec.backends.base import Runner, Scores, TreeMask, path_is_chain
from verispec.errors import UnsupportedModel

PREFILL_CHUNK = 256  # prompt tokens per prefill pass when a generation can be stopped between them

_MASKABLE_LAYERS = {"full_attention", "sliding_attention"}


def tree_mask_plan(model: torch.nn.Module) -> dict[str, int | None]:
    """How `model` takes a custom mask: {layer type: sliding window or None}. One entry means a single
    4-D tensor, several mean a dict keyed by layer type. Raises UnsupportedModel when it cannot."""
    cfg = model.config
    name = type(model).__name__
    impl = getattr(cfg, "_attn_implementation", None)
    if impl not in ("eager", "sdpa"):
        raise UnsupportedModel(f"{name} uses the '{impl}' attention implementation, which cannot take a custom tree "
                               "attention mask; load it with attn_implementation='sdpa' or 'eager', or use a chain "
                               "(no --tree)")
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModel(f"{name} is an encoder-decoder model; tree verification needs a decoder-only model")
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        unknown = set(layer_types) - _MASKABLE_LAYERS
        if unknown:
            raise UnsupportedModel(f"{name} has layers of type {', '.join(sorted(unknown))}, which cannot take a custom "
                                   "tree attention mask; use a chain (no --tree)")
        return {t: (window if t == "sliding_attention" else None) for t in dict.fromkeys(layer_types)}
    use_window = window is not None and getattr(cfg, "use_sliding_window", True)
    return {"sliding_attention" if use_window else "full_attention": window if use_window else None}


def build_tree_mask(plan: dict[str, int | None], allowed: torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor,
                    dtype: torch.dtype):
    """allowed BoolTensor [n, m] (m = kv length), positions of queries [n] and keys [m] -> the mask input
    for the model: a float tensor [1, 1, n, m] (0 = attend, dtype min = masked) or a dict of them."""
    neg = torch.finfo(dtype).min
    out = {}
    for layer_type, window in plan.items():
        ok = allowed if window is None else allowed & ((q_pos[:, None] - kv_pos[None, :]) < window)
        out[layer_type] = torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill(~ok, neg)[None, None]
    return next(iter(out.values())) if len(out) == 1 else out


class HFRunner(Runner):
    """The Runner contract (backends/base.py) over a transformers model and a DynamicCache. Each sequence
    runs its own forwards (a DynamicCache per runner): the default batch_key, None."""

    prefill_chunk = PREFILL_CHUNK
    can_features = True

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.device = next(model.parameters()).device
        self.cache = DynamicCache()
        self.length = 0  # positions held in the cache
        self._mask_plan: dict[str, int | None] | None = None

    def reset(self, params=None) -> None:
        self.cache = DynamicCache()
        self.length = 0

    @torch.inference_mode()
    def run_model(self, ids: torch.Tensor | list[int], last_only: bool = False,
                  attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                  features: tuple[int, ...] = ()) -> Scores:
        """forward with the model's own inputs: an optional custom 4-D mask and positions."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).reshape(1, -1)
        n = ids.shape[1]
        if position_ids is None:
            position_ids = torch.arange(self.length, self.length + n, device=self.device)[None]
        kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, position_ids=position_ids,
                         logits_to_keep=1 if last_only else 0, output_hidden_states=bool(features), **kwargs)
        self.length += n
        feats = torch.cat([out.hidden_states[i][0] for i in features], dim=-1) if features else None
        return Scores(out.logits[0], feats)

    def check_tree_support(self) -> None:
        if self._mask_plan is None:
            self._mask_plan = tree_mask_plan(self.model)

    def forward(self, ids, tree: TreeMask | None = None, *, last_only: bool = False,
                features: tuple[int, ...] = ()) -> Scores:
        if tree is None:
            return self.run_model(ids, last_only=last_only, features=features)
        self.check_tree_support()
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).reshape(-1)
        n = ids.shape[0]
        start, ancestor_mask, depths = tree.checked(n, self.length, self.device)
        allowed = torch.ones(n, self.length + n, dtype=torch.bool, device=self.device)
        allowed[:, start:] = ancestor_mask
        kv_pos = torch.cat([torch.arange(start, device=self.device), start + depths])
        q_pos = kv_pos[-n:]
        mask = build_tree_mask(self._mask_plan, allowed, q_pos, kv_pos, next(self.model.parameters()).dtype)
        return self.run_model(ids, attention_mask=mask, position_ids=q_pos[None], last_only=last_only,
                              features=features)

    def _layers(self) -> list:
        return [layer for layer in self.cache.layers if getattr(layer, "is_initialized", False) and layer.keys is not None]

    def rollback(self, length: int) -> None:
        if length < self.length:
            for layer in self._layers():
                layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]
            self.length = length

    def commit(self, start: int, keep: list[int]) -> None:
        if path_is_chain(keep):
            return self.rollback(start + len(keep))
        for layer in self._layers():
            idx = torch.as_tensor(keep, dtype=torch.long, device=layer.keys.device) + start
            layer.keys = torch.cat([layer.keys[..., :start, :], layer.keys.index_select(-2, idx)], dim=-2)
            layer.values = torch.cat([layer.values[..., :start, :], layer.values.index_select(-2, idx)], dim=-2)
        self.length = start + len(keep)
