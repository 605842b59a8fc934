"""`verispec generate` and `verispec models`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from verispec.commands import fail, friendly
from verispec.commands.speculation import speculation_flags
from verispec.models.registry import WEIGHTS_HELP
from verispec.options import SpeculationSettings

out = Console(highlight=False)


def _read_prompt(prompt: Optional[str], prompt_file: Optional[Path]) -> Optional[str]:
    if prompt_file is not None:
        if prompt_file.is_dir():
            fail(f"--prompt-file {prompt_file} is a directory; give a text file")
        data = prompt_file.read_bytes()
        return data.decode("utf-8")  # invalid UTF-8 raises UnicodeDecodeError -> one-line error
    return prompt


@friendly
@speculation_flags
def generate(
    prompt: Optional[str] = typer.Argument(None, help="Raw prompt text (or use --chat / --prompt-file)."),
    chat: Optional[str] = typer.Option(None, "--chat", "-c", help="A user chat message, wrapped in the model's chat template."),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", help="Read the prompt (UTF-8) from a file."),
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Embedded default, model directory, .gguf file or hub id."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy."),
    top_k: int = typer.Option(0, "--top-k", help="0 = off."),
    top_p: float = typer.Option(1.0, "--top-p", help="1 = off."),
    seed: Optional[int] = typer.Option(None, "--seed"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n"),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16."),
    weights: str = typer.Option("auto", "--weights", help=WEIGHTS_HELP),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda or auto."),
    compare: bool = typer.Option(False, "--compare", help="Also run plain decoding on the same input and print the speedup."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Do not stream the text, print only the statistics."),
    settings: SpeculationSettings = None,
):
    """Generate text with speculative decoding, streaming tokens as they are accepted (speculation flags:
    verispec.options.SpeculationSettings)."""
    from verispec.api import build_engine
    from verispec.models import load_model
    from verispec.types import SamplingParams

    text = _read_prompt(prompt, prompt_file)
    if text is None and chat is None:
        fail("give a prompt, --chat MESSAGE or --prompt-file FILE")
    if text is not None and chat is not None:
        fail("give either a prompt or --chat, not both")
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                            max_new_tokens=max_new_tokens, stop=tuple(stop))
    tree = settings.tree
    if tree.shape is None and (tree.budget is not None or tree.topk is not None or tree.depth is not None):
        fail("--tree-budget, --tree-topk and --tree-depth need --tree")
    from verispec.tree import parse_tree

    parse_tree(tree.shape, budget=tree.budget, topk=tree.topk, depth=tree.depth)  # how the tree options combine
    target = load_model(model, dtype=dtype, device=device, weights=weights)
    ids = target.encode(prompt=text, chat=chat)
    engine = build_engine(target, settings=settings)
    method = settings.method
    plain_engine = None
    if compare and method != "ar":
        # untimed warm-ups of both, as the bench does: an engine's first generation pays one-time costs (the
        # auto tree budget's cost curve, first kernel calls) that are not its method's speed
        from dataclasses import replace

        warm = replace(params, max_new_tokens=min(8, params.max_new_tokens))
        plain_engine = build_engine(target, settings=SpeculationSettings(backend=settings.backend))
        for e in (engine, plain_engine):
            e.generate(ids, warm)
            e.forget()  # the warm-up's answer is not for the suffix cache to draft from
    for event in engine.stream(ids, params):
        if not quiet:
            out.print(event.text, end="", markup=False)
    result = engine.last
    if not quiet:
        out.print()
    out.print(f"[dim]{method}: {result.stats.summary()} (finish: {result.finish_reason})[/]")
    if compare and method != "ar":
        plain = plain_engine.generate(ids, params)
        speedup = plain.stats.total_time / result.stats.total_time if result.stats.total_time else 0.0
        same = "identical" if plain.token_ids == result.token_ids else "DIFFERENT"
        out.print(f"[dim]ar: {plain.stats.summary()}[/]")
        out.print(f"[bold]speedup {speedup:.2f}x over plain decoding; output {same} to plain decoding[/]")


@friendly
def models():
    """List the embedded default models and the conversion cache."""
    from verispec.models.registry import EMBEDDED, cache_dir

    table = Table(title="embedded models")
    table.add_column("name")
    table.add_column("description")
    table.add_column("converted")
    for name, entry in EMBEDDED.items():
        conv = cache_dir() / "converted" / name
        table.add_row(name, entry.description, str(conv) if (conv / "config.json").exists() else "not yet")
    out.print(table)
    out.print(f"cache: {cache_dir()}  (set VERISPEC_CACHE or XDG_CACHE_HOME to move it)")
