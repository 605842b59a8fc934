"""A GGUF file's own weights for the fast path's quantized formats (fast/quant.py).

`GGUFWeights.get(name)` answers, for a transformers parameter name of a Llama-family or Gemma 3 model,
the GGUF's 4-bit blocks (Q4_0 / Q4_1, and Q4_K, whose 256-weight super-blocks are 8 groups of 32 with
a 6-bit scale and minimum each) as quant.Groups, else the float32 weight as the file dequantizes (read from
the converted safetensors, which transformers wrote from the same dequantization), so that the int8
requantization starts from the file's values, not from a bfloat16 rounding of them.

The blocks are checked, not trusted: llama.cpp's converter permutes the rows of q and k for its rotary
layout for Llama (transformers undoes it on load; Gemma's are not permuted), so the blocks are taken
in transformers' row order, with or without that permutation, and their dequantization must equal the converted float32 weight bit for bit; a tensor that does not (another
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


def parse_q4_k(raw: np.ndarray, shape: tuple[int, int]) -> Groups:
    """The bytes of a Q4_K tensor -> Groups. A 144-byte super-block of 256 weights: fp16 d and dmin, 12
    bytes holding eight 6-bit scales sc and mins mn, 128 bytes of nibbles; group j is
    w = (d * sc_j) * q - dmin * mn_j, its 32 nibbles the low (j even) or high (j odd) halves of
    bytes 32 * (j // 2) .. + 31."""
    n, k = shape
    sb = np.ascontiguousarray(raw).reshape(n, k // 256, 144)
    d = sb[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = sb[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    s = sb[..., 4:16].astype(np.uint16)
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    # groups 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); groups 4-7: a nibble of bytes
    # 8-11 below the top 2 bits of bytes 0-3 (scales) or 4-7 (mins)
    sc = np.concatenate((lo & 63, (hi & 15) | ((lo >> 6) << 4)), axis=-1).astype(np.float32)
    mn = np.concatenate((mid & 63, (hi >> 4) | ((mid >> 6) << 4)), axis=-1).astype(np.float32)
    qs = sb[..., 16:].reshape(n, k // 256, 4, 32)
    q = np.stack((qs & 0x0F, qs >> 4), axis=3).reshape(n, k)  # chunk c: group 2c (low), 2c + 1 (high)
    gd = (d[..., None] * sc).reshape(n, k // GROUP)  # fp16 x 6-bit: exact in float32
    gm = -(dmin[..., None] * mn).reshape(n, k // GROUP)
    return Groups(torch.from_numpy(q.astype(np.uint8)), torch.from_numpy(np.ascontiguousarray(gd)),
                  torch.from_numpy(np.ascontiguousarray(gm)))


def rope_rows(n_rows: int, n_heads: int) -> torch.Tensor:
    """Index r -> the GGUF row holding transformers' row r of a q or k weight: llama.cpp stores each
    head's rows as (pairs, 2) where transformers has (2, pairs)."""
    per = n_rows // n_heads
    return torch.arange(n_rows).reshape(n_heads, per // 2, 2).transpose(1, 2).reshape(-1)


class GGUFWeights:
    """Weights of one GGUF file (Llama family) by transformers parameter name; see the module docstring.
    Called as a function (a weight source of fast/decoder.py); the file is opened on first use (its
    index is slow to read), and one object per loaded model keeps the runners' shared modules shared."""

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
        if t is None or t.tensor_type.name not in ("Q4_0", "Q4_1", "Q4_K") or ref is None:
            return ref
        if t.tensor_type.name == "Q4_K":
            groups = parse_q4_k(np.asarray(t.data), tuple(ref.shape))
        else:
            groups = parse_q4(np.asarray(t.data), t.tensor_type.name, tuple(ref.shape))
        candidates = [groups]
        heads = self._heads.get("q" if "q_proj" in name else "k") if ("q_proj" in name or "k_proj" in name) else None
        if heads:  # Llama's q and k rows are permuted in the file; try that order first
            idx = rope_rows(ref.shape[0], heads)
            candidates.insert(0, Groups(groups.q[idx], groups.d[idx], groups.m[idx]))
        for g in candidates:
            if torch.equal(g.dense(), ref):
                return g
        log.warning("%s: the GGUF blocks of %s do not match its dequantized weight; requantizing it instead",
                    self.gguf.name, name)
        return ref
