"""A causal LM together with its KV cache: feed new tokens, get their logits, roll back.

This is the only place the engine touches a transformers model, so other backends (a compiled fast
path, a mock table model in tests) only need the same four members: `length`, `reset`, `forward`, `crop`
(and `forward_tree` + `compact` for tree speculation).

Tree verification goes through the model's standard inputs: explicit position ids (context length +
depth) and a custom 4-D additive float mask [1, 1, n, length + n], which transformers passes through
unchanged (masking_utils._preprocess_mask_arguments returns a 4-D mask as-is). Models that mix layer
types (Gemma 3: sliding-window and full-attention layers) take a dict keyed by layer type instead,
the same mapping their forward builds for itself; we build the sliding-window variant ourselves from
positions (a key is visible when query position - key position < window, transformers'
sliding_window_overlay), since the KV cache keeps every position in every layer (cache.py).
"""

from __future__ import annotations

import torch

from verispec import cache as kv
from verispec.errors import UnsupportedModel

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


class HFRunner:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.device = next(model.parameters()).device
        self.cache = kv.new_cache()
        self.length = 0  # positions held in the cache
        self._mask_plan: dict[str, int | None] | None = None
        # hidden-state indices to keep from every forward (transformers' numbering: i = output of decoder
        # layer i - 1, num_hidden_layers = the final normed state), set for drafters that read the
        # target's features (EAGLE, Medusa); last_features [n, len * hidden] then holds them
        self.feature_layers: tuple[int, ...] | None = None
        self.last_features = None

    def reset(self) -> None:
        self.cache = kv.new_cache()
        self.length = 0

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor | list[int], last_only: bool = False,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                output_hidden_states: bool = False):
        """ids [n] appended after the cached positions -> logits [n, V] (or [1, V] with last_only).

        attention_mask / position_ids: optional custom 4-D mask and positions (tree verification).
        """
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).reshape(1, -1)
        n = ids.shape[1]
        if position_ids is None:
            position_ids = torch.arange(self.length, self.length + n, device=self.device)[None]
        kwargs = {}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        want = output_hidden_states or bool(self.feature_layers)
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, position_ids=position_ids,
                         logits_to_keep=1 if last_only else 0, output_hidden_states=want, **kwargs)
        self.length += n
        self.last_hidden_states = out.hidden_states if output_hidden_states else None
        if self.feature_layers:
            self.last_features = torch.cat([out.hidden_states[i][0] for i in self.feature_layers], dim=-1)
        return out.logits[0]

    def check_tree_support(self) -> None:
        """Raise UnsupportedModel now (not mid-generation) when the model cannot take a tree mask."""
        if self._mask_plan is None:
            self._mask_plan = tree_mask_plan(self.model)

    def forward_tree(self, ids: torch.Tensor | list[int], ancestor_mask: torch.Tensor, depths: torch.Tensor,
                     tree_start: int | None = None) -> torch.Tensor:
        """Verify a tree in one forward: ids [n] appended after the cached positions -> logits [n, V].

        ancestor_mask BoolTensor [n, n]: node i sees every cached position and node j iff mask[i, j]
        (True on the diagonal). depths LongTensor [n]: node i's position id is length + depths[i].

        tree_start (extension, for drafters that grow a tree over several calls): the cached slots from
        tree_start on are earlier nodes of the same tree; then ancestor_mask is [n, length - tree_start + n]
        over those slots and the new ones, depths covers them too, and positions are tree_start + depths.
        """
        self.check_tree_support()
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).reshape(-1)
        n = ids.shape[0]
        start = self.length if tree_start is None else tree_start
        tree_cols = self.length - start + n
        ancestor_mask = torch.as_tensor(ancestor_mask, dtype=torch.bool, device=self.device)
        depths = torch.as_tensor(depths, dtype=torch.long, device=self.device).reshape(-1)
        if ancestor_mask.shape != (n, tree_cols) or depths.shape[0] != tree_cols:
            raise ValueError(f"tree of {n} new nodes over {tree_cols} tree slots needs ancestor_mask [{n}, {tree_cols}] "
                             f"and depths [{tree_cols}], got {tuple(ancestor_mask.shape)} and {tuple(depths.shape)}")
        total = self.length + n
        allowed = torch.ones(n, total, dtype=torch.bool, device=self.device)
        allowed[:, start:] = ancestor_mask
        kv_pos = torch.cat([torch.arange(start, device=self.device), start + depths])
        q_pos = kv_pos[-n:]
        dtype = next(self.model.parameters()).dtype
        mask = build_tree_mask(self._mask_plan, allowed, q_pos, kv_pos, dtype)
        return self.forward(ids, attention_mask=mask, position_ids=q_pos[None])

    def crop(self, length: int) -> None:
        if length < self.length:
            kv.crop(self.cache, length)
            self.length = length

    def compact(self, start: int, keep: list[int]) -> None:
        kv.compact(self.cache, start, keep)
        self.length = start + len(keep)
