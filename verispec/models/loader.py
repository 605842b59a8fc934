"""Load a causal LM and its tokenizer: embedded default, local directory, GGUF file or hub id.

GGUF files are dequantized by transformers (slowly: docs/performance-notes.md), so the result is saved once as safetensors under
cache_dir()/converted/<name>; later loads read that in a few seconds.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from verispec.errors import InvalidParameter, InvalidPrompt, ModelNotFound
from verispec.models.registry import EMBEDDED, cache_dir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

log = logging.getLogger(__name__)


def check_unicode(text) -> None:
    """Tokenizers take valid Unicode only: a lone surrogate (JSON "\\ud800", or bytes a command line
    could not decode) becomes InvalidPrompt here instead of an error from inside the tokenizer."""
    if isinstance(text, str):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidPrompt(f"the prompt holds a lone surrogate (U+{ord(text[exc.start]):04X}) at character "
                                f"{exc.start}, which is not valid Unicode; send valid UTF-8 text") from None


@dataclass
class LoadedModel:
    """A causal LM ready for the engine: the transformers model, its tokenizer and where it came from."""

    name: str
    model: "torch.nn.Module"
    tokenizer: object
    dtype: torch.dtype
    device: torch.device
    gguf_path: Path | None = None  # the original GGUF file, for baselines that read GGUF (llama.cpp)
    context_length: int = 2048
    # the fast path's weights format: "auto", "bf16" (dense), "q8", "q4" (verispec/fast/quant.py)
    weights: str = "auto"
    converted_path: Path | None = None  # the GGUF's float32 dequantization, as safetensors
    _source: object = None

    @property
    def weight_source(self):
        """name -> the GGUF's own weights (models/gguf_weights.py) for a model loaded from a GGUF, else
        None. One object per loaded model (runners share the modules built from it), opened on first use."""
        if self.gguf_path is None or self.converted_path is None:
            return None
        if self._source is None:
            from verispec.models.gguf_weights import GGUFWeights

            self._source = GGUFWeights(self.gguf_path, self.converted_path)
        return self._source

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.model.config):
            eos = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(int(e) for e in eos)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    def encode(self, prompt: str | None = None, chat: str | list[dict] | None = None) -> list[int]:
        """Token ids for a raw prompt, or for a chat (one user message or a list of messages) through
        the tokenizer's chat template."""
        if (prompt is None) == (chat is None):
            raise InvalidPrompt("give either a prompt or a chat message, not both or neither")
        for text in [prompt] if chat is None else [chat] if isinstance(chat, str) else [m.get("content") for m in chat]:
            check_unicode(text)
        if chat is not None:
            messages = [{"role": "user", "content": chat}] if isinstance(chat, str) else list(chat)
            if not messages or not any(str(m.get("content", "")).strip() for m in messages):
                raise InvalidPrompt("the chat message is empty; give some text")
            if getattr(self.tokenizer, "chat_template", None):
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                if isinstance(ids, Mapping):  # a BatchEncoding (newer transformers), else a list
                    ids = ids["input_ids"]
                ids = list(ids)
            else:
                text = "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"
                ids = self.tokenizer(text)["input_ids"]
        else:
            if not prompt or not prompt.strip():
                raise InvalidPrompt("the prompt is empty; give some text")
            ids = list(self.tokenizer(prompt)["input_ids"])
        if not ids:
            raise InvalidPrompt("the prompt produced no tokens; give some text")
        return [int(i) for i in ids]

    def check_length(self, n_prompt: int, max_new_tokens: int) -> None:
        if n_prompt >= self.context_length:
            raise InvalidPrompt(
                f"the prompt has {n_prompt} tokens but {self.name} takes at most {self.context_length}; shorten it"
            )

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise InvalidParameter(f"unknown dtype '{dtype}'; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidParameter("device 'cuda' was asked for but no CUDA GPU is available; use --device cpu")
    return dev


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF file with transformers and save it as ordinary safetensors + tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning("converting %s to safetensors once (this takes 15-90 s)...", gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # a GGUF-loaded model refuses save_pretrained; once dequantized it is an ordinary model
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=out_dir.name + ".tmp"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)  # atomic: a half-written conversion is never picked up
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def converted_dir(gguf: Path, name: str | None = None) -> Path:
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:10]
    return cache_dir() / "converted" / (name or f"{gguf.stem}-{key}")


def _from_pretrained(path: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model.to(device).eval(), tokenizer


def load_model(name: str, dtype: str | torch.dtype = "float32", device: str | torch.device | None = "cpu",
               weights: str = "auto") -> LoadedModel:
    """Load `name`: an embedded default (see `verispec models`), a local model directory, a .gguf
    file, or a hub id (where a network allows). weights: the fast path's weights format, "auto",
    "bf16" (dense), "q8" or "q4" (a GGUF's own 4-bit blocks where it has them; verispec/fast/quant.py)."""
    from verispec.fast.quant import FORMATS

    if weights not in ("auto", *FORMATS):
        raise InvalidParameter(f"unknown weights '{weights}'; use one of auto, {', '.join(FORMATS)}")
    torch_dtype = _resolve_dtype(dtype)
    dev = _resolve_device(device)
    gguf: Path | None = None
    context = None
    if name in EMBEDDED:
        entry = EMBEDDED[name]
        gguf = entry.gguf_path()
        path = converted_dir(gguf, name)
        context = entry.context_length
        if not (path / "config.json").exists():
            _convert_gguf(gguf, path)
    elif name.endswith(".gguf"):
        gguf = Path(name).expanduser()
        if not gguf.is_file():
            raise ModelNotFound(f"GGUF file '{name}' does not exist; give the path of an existing .gguf file")
        path = converted_dir(gguf)
        if not (path / "config.json").exists():
            _convert_gguf(gguf, path)
    elif Path(name).expanduser().is_dir():
        path = Path(name).expanduser()
        if not (path / "config.json").exists():
            raise ModelNotFound(f"'{name}' is a directory without config.json; give a transformers model directory")
    elif "/" in name and not name.startswith((".", "/")):
        path = name  # a hub id: transformers fetches it where a network allows
    else:
        known = ", ".join(EMBEDDED)
        raise ModelNotFound(f"unknown model '{name}'; use an embedded default ({known}), a model directory, a .gguf file or a hub id")
    try:
        model, tokenizer = _from_pretrained(str(path), torch_dtype, dev)
    except OSError as exc:
        raise ModelNotFound(f"could not load '{name}': {str(exc).splitlines()[0]}") from exc
    if context is None:
        context = int(getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", 2048) or 2048)
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, dtype=torch_dtype, device=dev, gguf_path=gguf,
                       context_length=context, weights=weights, converted_path=Path(path) if gguf is not None else None)


def from_model(model: "torch.nn.Module", tokenizer: object, name: str = "custom") -> LoadedModel:
    """Wrap an already built transformers model (tests build tiny random ones)."""
    p = next(model.parameters())
    context = int(getattr(model.config, "max_position_embeddings", 2048) or 2048)
    return LoadedModel(name=name, model=model.eval(), tokenizer=tokenizer, dtype=p.dtype, device=p.device, context_length=context)
