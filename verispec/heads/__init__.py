"""Trained drafter heads: the checkpoint format, and the heads shipped in the package.

A head is a folder with two files:

    model.safetensors   the head's weights (the target's own embedding is not stored: it is read from
                        the target at load time); `d2t` maps draft-vocabulary index -> target token id
    config.json         {"kind": "eagle" | "medusa" | "dflash", "target": {name, model_type, vocab_size, hidden_size,
                        num_hidden_layers, embed_fingerprint}, "feature_layers": [...], "draft_vocab_size",
                        the head's own shape, and "training": how it was trained and what it reached}

EAGLE-3 heads in vLLM's `speculators` format or SGLang's layout are read and written by interop.py
(`read_head` takes any of the three). `check_target` refuses a head for another target (HeadMismatch): the architecture must match exactly
and a fingerprint of the embedding must agree, so a head trained on one checkpoint is not silently used
on another of the same shape. Shipped heads live in verispec/heads/<target name>/<kind>/.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from verispec.errors import HeadMismatch

HEADS_DIR = Path(__file__).resolve().parent
FORMAT_VERSION = 1


def _embedding(model) -> torch.Tensor:
    return model.get_input_embeddings().weight


def embed_fingerprint(model) -> float:
    """Mean absolute value of the first 256 embedding rows: equal across float32/bfloat16 loads of the
    same weights to ~3 digits, different for other weights."""
    w = _embedding(model).detach()
    return float(w[: min(256, w.shape[0])].float().abs().mean())


def target_identity(target) -> dict:
    """What a head records about its target (a verispec LoadedModel)."""
    cfg = target.model.config
    return {"name": target.name, "model_type": getattr(cfg, "model_type", None),
            "vocab_size": int(target.vocab_size), "hidden_size": int(cfg.hidden_size),
            "num_hidden_layers": int(cfg.num_hidden_layers), "embed_fingerprint": round(embed_fingerprint(target.model), 6)}


def check_target(config: dict, target, where: str = "this head") -> None:
    """Raise HeadMismatch unless `config` (a head's config.json) was trained for `target`."""
    want = config.get("target") or {}
    have = target_identity(target)
    for key in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers"):
        if want.get(key) != have[key]:
            raise HeadMismatch(f"{where} was trained for '{want.get('name')}' ({key} {want.get(key)}), not for "
                               f"'{target.name}' ({key} {have[key]}); train one with: verispec train "
                               f"{config.get('kind', 'eagle')} --target {target.name}")
    fp_want, fp_have = float(want.get("embed_fingerprint", 0.0)), have["embed_fingerprint"]
    if abs(fp_want - fp_have) > 0.01 * max(abs(fp_want), abs(fp_have), 1e-12):
        raise HeadMismatch(f"{where} was trained for '{want.get('name')}', whose weights differ from "
                           f"'{target.name}' (embedding fingerprint {fp_want:.6g} vs {fp_have:.6g}); train one with: "
                           f"verispec train {config.get('kind', 'eagle')} --target {target.name}")


def save_head(path: str | Path, config: dict, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a head folder (weights in `dtype`, integer tensors kept as they are)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous().cpu() for k, v in state.items()}
    tmp = path / "model.safetensors.tmp"
    save_file(tensors, str(tmp))
    tmp.replace(path / "model.safetensors")  # a half-written checkpoint is never picked up
    (path / "config.json").write_text(json.dumps({**config, "format_version": FORMAT_VERSION}, indent=2) + "\n")
    return path


def load_head_files(path: str | Path, kind: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of a head folder, or HeadMismatch saying what is wrong with it."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise HeadMismatch(f"'{path}' is not a head folder (needs config.json and model.safetensors)")
    config = json.loads((path / "config.json").read_text())
    if config.get("kind") != kind:
        raise HeadMismatch(f"'{path}' holds a {config.get('kind')!r} head, not a {kind!r} head")
    return config, load_file(str(path / "model.safetensors"))


def read_head(path: str | Path, kind: str, target) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of the head folder at `path` for `target`, checked: a verispec head, or an EAGLE-3
    head in vLLM's speculators format or SGLang's layout (heads/interop.py turns those into verispec's)."""
    from verispec.heads.interop import foreign_format, import_head

    fmt = foreign_format(path)
    if fmt is not None:
        if kind != "eagle":
            raise HeadMismatch(f"'{path}' holds an EAGLE-3 head ({fmt} format), not a {kind} head")
        return import_head(path, target)
    config, tensors = load_head_files(path, kind)
    check_target(config, target, where=f"the {kind} head at '{path}'")
    return config, tensors


def shipped_head(target_name: str, kind: str) -> Path | None:
    """The head shipped in the package for an embedded target, or None."""
    path = HEADS_DIR / target_name / kind
    return path if (path / "config.json").is_file() else None


def resolve_head(target, kind: str, head: str | Path | None) -> Path:
    """The head folder to use: `head` when given, else the shipped one for the target."""
    if head is not None:
        return Path(head).expanduser()
    found = shipped_head(target.name, kind)
    if found is None:
        raise HeadMismatch(f"no {kind} head is shipped for '{target.name}'; train one with: verispec train {kind} "
                           f"--target {target.name}, then pass head=<folder> (CLI: --head FOLDER)")
    return found
