"""A GGUF file's own weights for the fast path's quantized formats (fast/quant.py).

`GGUFWeights.get(name)` answers, for a transformers parameter name of a Llama-family model, the GGUF's
4-bit blocks (Q4_0 / Q4_1) as quant.Groups, else the float32 weight as the file dequantizes (read from
the converted safetensors, which transformers wrote from the same dequantization), so that the int8
requantization starts from the file's values, not from a bfloat16 rounding of them.

The blocks are checked, not trusted: llama.cpp's converter permutes the rows of q and k for its rotary
layout (transformers undoes it on load), so the blocks are taken in transformers' row order and their
dequantization must equal the converted float32 weight bit for bit; a tensor that does not (another
layout, another family) is given as the float32 weight instead, with a log line.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import torch

from verispec.fast.quant import GROUP, Groups

log = logging.getLogger(__name__)

_LLAMA = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}


def parse_q4(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> Groups:
    """The bytes of a Q4_0 / Q4_1 tensor ([N, bytes per row] uint8) -> Groups. A Q4_1 block is fp16 d,
    fp16 m, 16 bytes of nibbles (element i in the low nibble of byte i, element 16 + i in its high
    one); Q4_0 has no m (w = d * (q - 8))."""
    n, k = shape
    head = 4 if kind == "Q4_1" else 2
    blocks = np.ascontiguousarray(raw).reshape(n, k // GROUP, head + GROUP // 2)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "Q4_1" else -8 * d
    nib = blocks[..., head:]
    q = np.concatenate((nib & 0x0F, nib >> 4), axis=-1).reshape(n, k)
    return Groups(torch.from_numpy(q.astype(np.uint8)), torch.from_numpy(d), torch.from_numpy(np.ascontiguousarray(m)))


def rope_rows(n_rows: int, n_heads: int) -> torch.Tensor:
    """Index r -> the GGUF row holding transformers' row r of a q or k weight: llama.cpp stores each
    head's rows as (pairs, 2) where transformers has (2, pairs)."""
    per = n_rows // n_heads
    return torch.arange(n_rows).reshape(n_heads, per // 2, 2).transpose(1, 2).reshape(-1)


class GGUFWeights:
    """Weights of one GGUF file (Llama family) by transformers parameter name; see the module docstring.
    Called as a function (a weight source of fast/decoder.py); the file is opened on first use (its
    index takes ~2 s to read), and one object per loaded model keeps the runners' shared modules shared."""

    def __init__(self, gguf: Path, converted: Path):
        self.gguf, self.converted = Path(gguf), Path(converted)
        self._tensors = None
        self._dense = None

    def __call__(self, name: str) -> Groups | torch.Tensor | None:
        return self.get(name)

    def _open(self) -> None:
        from gguf import GGUFReader

        reader = GGUFReader(str(self.gguf))
        self._tensors = {t.name: t for t in reader.tensors}
        arch = reader.fields["general.architecture"]
        arch = bytes(arch.parts[arch.data[0]]).decode()
        self._heads = {}
        for key, field in (("q", f"{arch}.attention.head_count"), ("k", f"{arch}.attention.head_count_kv")):
            if field in reader.fields:
                f = reader.fields[field]
                self._heads[key] = int(f.parts[f.data[0]][0])

    def _gguf_name(self, name: str) -> str | None:
        if name == "lm_head.weight":
            return "output.weight" if "output.weight" in self._tensors else "token_embd.weight"
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name)
        if m and m.group(2) in _LLAMA:
            return f"blk.{m.group(1)}.{_LLAMA[m.group(2)]}.weight"
        return None

    def dense(self, name: str) -> torch.Tensor | None:
        """The file's float32 dequantization of `name` (from the converted safetensors), or None."""
        if self._dense is None:
            from safetensors import safe_open

            files = sorted(self.converted.glob("*.safetensors"))
            self._dense = {}
            for f in files:
                with safe_open(str(f), "pt") as fh:
                    for key in fh.keys():
                        self._dense[key] = f
        if name == "lm_head.weight" and name not in self._dense:
            name = "model.embed_tokens.weight"  # tied embeddings
        if name not in self._dense:
            return None
        from safetensors import safe_open

        with safe_open(str(self._dense[name]), "pt") as fh:
            return fh.get_tensor(name).float()

    def get(self, name: str) -> Groups | torch.Tensor | None:
        """The GGUF's 4-bit blocks for `name` where it has them (checked against the float32 weight),
        else the float32 weight, else None."""
        if self._tensors is None:
            self._open()
        ref = self.dense(name)
        t = self._tensors.get(self._gguf_name(name) or "")
        if t is None or t.tensor_type.name not in ("Q4_0", "Q4_1") or ref is None:
            return ref
        groups = parse_q4(np.asarray(t.data), t.tensor_type.name, tuple(ref.shape))
        if "q_proj" in name or "k_proj" in name:
            heads = self._heads.get("q" if "q_proj" in name else "k")
            if heads:
                idx = rope_rows(ref.shape[0], heads)
                groups = Groups(groups.q[idx], groups.d[idx], groups.m[idx])
        if not torch.equal(groups.dense(), ref):
            log.warning("%s: the GGUF blocks of %s do not match its dequantized weight; requantizing it instead",
                        self.gguf.name, name)
            return ref
        return groups
