"""KV cache operations the loop needs on a transformers DynamicCache: crop to a length, compact a path.

We build the cache without a config, so every layer (sliding-window layers of Gemma 3 included) keeps
all its entries and position i of the sequence is slot i of every layer. The model's own mask code
still applies the sliding window, from positions. That makes rollback a slice and tree compaction an
index copy, for every family alike.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache() -> DynamicCache:
    return DynamicCache()


def cache_length(cache: DynamicCache) -> int:
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
            return int(layer.keys.shape[-2])
    return 0


def crop(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions of every layer (rollback after a rejection)."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False) and layer.keys is not None:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def compact(cache: DynamicCache, start: int, keep: torch.Tensor | list[int]) -> None:
    """Move the entries at positions start + keep[i] to position start + i, then drop everything after.

    Used after tree verification: the accepted path's nodes sit at scattered slots after `start`.
    """
    keep_t = torch.as_tensor(keep, dtype=torch.long)
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False) and layer.keys is not None:
            idx = keep_t.to(layer.keys.device) + start
            layer.keys = torch.cat([layer.keys[..., :start, :], layer.keys.index_select(-2, idx)], dim=-2)
            layer.values = torch.cat([layer.values[..., :start, :], layer.values.index_select(-2, idx)], dim=-2)
