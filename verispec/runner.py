"""A causal LM together with its KV cache: feed new tokens, get their logits, roll back.

This is the only place the engine touches a transformers model, so other backends (a compiled fast
path, a mock table model in tests) only need the same four members: `length`, `reset`, `forward`, `crop`.
"""

from __future__ import annotations

import torch

from verispec import cache as kv


class HFRunner:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.device = next(model.parameters()).device
        self.cache = kv.new_cache()
        self.length = 0  # positions held in the cache

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
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, position_ids=position_ids,
                         logits_to_keep=1 if last_only else 0, output_hidden_states=output_hidden_states, **kwargs)
        self.length += n
        self.last_hidden_states = out.hidden_states if output_hidden_states else None
        return out.logits[0]

    def crop(self, length: int) -> None:
        if length < self.length:
            kv.crop(self.cache, length)
            self.length = length

    def compact(self, start: int, keep: list[int]) -> None:
        kv.compact(self.cache, start, keep)
        self.length = start + len(keep)
