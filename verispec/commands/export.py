"""`verispec export`: write an EAGLE head in the format vLLM (speculators) or SGLang (EAGLE-3 layout) loads."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from verispec.commands import friendly

VERIFIERS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct", "gemma3-270m": "google/gemma-3-270m"}


@friendly
def export(
    to: str = typer.Option(..., "--to", help="speculators (vLLM) or eagle3 (SGLang / SpecForge layout)."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder to write config.json and model.safetensors into."),
    head: Optional[str] = typer.Option(None, "--head", help="The eagle head folder (verispec, speculators or EAGLE-3 format; default: the shipped one)."),
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="The head's target model (its embedding goes into the speculators format)."),
    verifier: Optional[str] = typer.Option(None, "--verifier", help="The target's Hugging Face id or path recorded for the engine (default: known for embedded models)."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="Weights dtype: bfloat16, float16 or float32."),
    speculative_tokens: int = typer.Option(3, "--speculative-tokens", help="speculators: the chain length recorded in the proposal method."),
):
    """Export an EAGLE head so vLLM or SGLang can serve it (see docs/interop.md)."""
    import torch

    from verispec.errors import InvalidParameter
    from verispec.heads import read_head, resolve_head
    from verispec.heads.interop import export_head
    from verispec.models.loader import load_model

    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if dtype not in dtypes:
        raise InvalidParameter(f"unknown --dtype '{dtype}'; use one of {', '.join(dtypes)}")
    if speculative_tokens < 1:
        raise InvalidParameter(f"--speculative-tokens must be >= 1, got {speculative_tokens}")
    target = load_model(model, dtype="float32")
    path = resolve_head(target, "eagle", head)
    config, tensors = read_head(path, "eagle", target)
    written = export_head(config, tensors, out, to, embedding=target.model.get_input_embeddings().weight,
                          verifier=verifier or VERIFIERS.get(target.name), dtype=dtypes[dtype],
                          speculative_tokens=speculative_tokens)
    typer.echo(f"wrote the {to} form of '{path}' to {written}")
