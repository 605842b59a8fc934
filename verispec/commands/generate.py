"""`verispec generate` and `verispec models`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from verispec.commands import fail, friendly
from verispec.models.registry import WEIGHTS_HELP
from verispec.options import method_help

out = Console(highlight=False)


def _read_prompt(prompt: Optional[str], prompt_file: Optional[Path]) -> Optional[str]:
    if prompt_file is not None:
        if prompt_file.is_dir():
            fail(f"--prompt-file {prompt_file} is a directory; give a text file")
        data = prompt_file.read_bytes()
        return data.decode("utf-8")  # invalid UTF-8 raises UnicodeDecodeError -> one-line error
    return prompt


@friendly
def generate(
    prompt: Optional[str] = typer.Argument(None, help="Raw prompt text (or use --chat / --prompt-file)."),
    chat: Optional[str] = typer.Option(None, "--chat", "-c", help="A user chat message, wrapped in the model's chat template."),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", help="Read the prompt (UTF-8) from a file."),
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Embedded default, model directory, .gguf file or hub id."),
    method: str = typer.Option("ar", "--method", help=method_help() + "."),
    draft: Optional[str] = typer.Option(None, "--draft", help="Draft model for --method draft (another tokenizer than the target's works: its text is re-tokenized)."),
    draft_length: int = typer.Option(5, "--draft-length", "-k", help="Tokens drafted per step."),
    adaptive: bool = typer.Option(False, "--adaptive", help="Adapt the draft length: longer after a full accept, shorter after a rejection."),
    ngram_max: int = typer.Option(3, "--ngram-max", help="Longest suffix the n-gram drafter matches."),
    suffix_cache: Optional[str] = typer.Option(None, "--suffix-cache", help="Method suffix: cross-request cache of earlier outputs: global (default), private or off."),
    suffix_alpha: Optional[float] = typer.Option(None, "--suffix-alpha", help="Method suffix: at most alpha x match length tokens drafted (default 1.0)."),
    suffix_min_prob: Optional[float] = typer.Option(None, "--suffix-min-prob", help="Method suffix: smallest path score drafted (default 0.1)."),
    suffix_depth: Optional[int] = typer.Option(None, "--suffix-depth", help="Method suffix: longest indexed substring (default 24)."),
    lookahead_window: Optional[int] = typer.Option(None, "--lookahead-window", help="Method lookahead: Jacobi window W, tokens per level (default 2)."),
    lookahead_ngram: Optional[int] = typer.Option(None, "--lookahead-ngram", help="Method lookahead: n-gram size N (default 3)."),
    lookahead_candidates: Optional[int] = typer.Option(None, "--lookahead-candidates", help="Method lookahead: n-grams verified per step G (default 2)."),
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
    tree: Optional[str] = typer.Option(None, "--tree", help="Draft a tree instead of a chain: dynamic, static:<name> (chain4, small, medium, large, xl) or static:'[[0],[1],[0,0]]'."),
    tree_budget: Optional[str] = typer.Option(None, "--tree-budget", help="Dynamic tree: nodes verified per step, or 'auto' (default) to choose it from the verification cost measured on this machine."),
    tree_topk: Optional[int] = typer.Option(None, "--tree-topk", help="Dynamic tree: children per expanded node and nodes expanded per depth (default 4)."),
    tree_depth: Optional[int] = typer.Option(None, "--tree-depth", help="Maximum tree depth (dynamic default 6; cuts a static tree)."),
    backend: str = typer.Option("auto", "--backend", help="auto (fast path when the model family has one), hf (transformers) or fast."),
    exact: Optional[bool] = typer.Option(None, "--exact/--no-exact", help="Fast path: same kernels and shapes for plain and speculative passes (default: on when greedy)."),
    compile_: bool = typer.Option(False, "--compile", help="Fast path: torch.compile the decode/verify passes (first calls are slow)."),
):
    """Generate text with speculative decoding, streaming tokens as they are accepted."""
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
    fast = {"backend": backend, "exact": exact, "compile": compile_}
    if tree is None and (tree_budget is not None or tree_topk is not None or tree_depth is not None):
        fail("--tree-budget, --tree-topk and --tree-depth need --tree")
    from verispec.options import check_speculation
    from verispec.tree import parse_tree

    tree_opts = {"tree": tree, "tree_budget": tree_budget, "tree_topk": tree_topk, "tree_depth": tree_depth} if tree else {}
    suffix_opts = {k: v for k, v in {"suffix_cache": suffix_cache, "suffix_alpha": suffix_alpha,
                                     "suffix_min_prob": suffix_min_prob, "suffix_depth": suffix_depth,
                                     "lookahead_window": lookahead_window, "lookahead_ngram": lookahead_ngram,
                                     "lookahead_candidates": lookahead_candidates}.items() if v is not None}
    # the schema the API and the server check with (verispec.options), before the model loads
    check_speculation(label=lambda field: "--" + field.replace("_", "-"), method=method, draft_length=draft_length,
                      adaptive=adaptive, ngram_max=ngram_max, backend=backend, exact=exact, **tree_opts, **suffix_opts)
    parse_tree(tree, budget=tree_budget, topk=tree_topk, depth=tree_depth)  # how the tree options combine
    target = load_model(model, dtype=dtype, device=device, weights=weights)
    ids = target.encode(prompt=text, chat=chat)
    engine = build_engine(target, method, draft=draft, draft_length=draft_length, adaptive=adaptive, ngram_max=ngram_max,
                          **fast, **tree_opts, **suffix_opts)
    plain_engine = None
    if compare and method != "ar":
        # untimed warm-ups of both, as the bench does: an engine's first generation pays one-time costs (the
        # auto tree budget's cost curve, first kernel calls) that are not its method's speed
        from dataclasses import replace

        warm = replace(params, max_new_tokens=min(8, params.max_new_tokens))
        plain_engine = build_engine(target, "ar", **fast)
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
