"""`verispec roofline`, `verispec theory`, `verispec bench` and `verispec report`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from verispec.commands import fail, friendly
from verispec.errors import InvalidParameter
from verispec.models.registry import WEIGHTS_HELP
from verispec.options import SpeculationSettings

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(text).name if text.endswith(".gguf") else text).strip("-")


def _threads(threads: Optional[int]) -> None:
    if threads is not None:
        import torch

        if threads < 1:
            fail(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)


@friendly
def roofline(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Embedded default, model directory, .gguf file or hub id."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda or auto."),
    context: int = typer.Option(200, "--context", help="Positions already in the KV cache before the timed forward."),
    max_n: int = typer.Option(256, "--max-n", help="Largest N (N = 1, 2, 4, ... up to it)."),
    repeats: int = typer.Option(7, "--repeats", help="Timed forwards per N (the median is reported)."),
    warmup: int = typer.Option(2, "--warmup", help="Untimed forwards per N first."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch CPU threads (default: torch's choice)."),
    backend: str = typer.Option("auto", "--backend", help="auto (the engine's default: the fast path where the family has one), hf or fast."),
    weights: str = typer.Option("auto", "--weights", help=WEIGHTS_HELP),
    output: Optional[Path] = typer.Option(None, "--out", "-o", help="JSON file (default results/MACHINE-KIND/bench/roofline-MODEL-DTYPE-DEVICE.json); the PNG goes next to it."),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
):
    """Time one target forward over N new positions (N = 1..256): the free positions of speculative decoding."""
    from tqdm.auto import tqdm

    from verispec.bench import roofline as rl
    from verispec.bench.report import plot_roofline, write_json
    from verispec.models import load_model

    _threads(threads)
    ns = rl.default_ns(max_n)
    target = load_model(model, dtype=dtype, device=device, weights=weights)
    bar = tqdm(total=len(ns), disable=not progress, desc="roofline", unit="N")
    result = rl.measure(target, context=context, ns=ns, repeats=repeats, warmup=warmup, backend=backend,
                        progress=lambda n: (bar.set_postfix_str(f"N={n}"), bar.update(1)))
    bar.close()
    import torch

    from verispec.bench.environment import environment

    result["environment"] = environment(target)
    result["environment"]["torch_threads"] = torch.get_num_threads()
    path = output or _results_dir() / f"roofline-{_slug(model)}-{result['dtype']}-{target.device.type}.json"
    write_json(result, path)
    png = plot_roofline(result, Path(path).with_suffix(".png"))
    out.print(rl.format_table(result))
    out.print(f"wrote {path} and {png}")


@friendly
def theory(
    alpha: list[float] = typer.Option([0.6, 0.7, 0.8, 0.9], "--alpha", "-a", help="Acceptance rate (repeatable)."),
    cost: float = typer.Option(0.05, "--cost", "-c", help="Draft cost per drafted token, in target forwards."),
    k_max: int = typer.Option(12, "--k-max", help="Largest draft length considered."),
    roofline_file: Optional[Path] = typer.Option(None, "--roofline", help="A roofline JSON: use its measured verification cost instead of a flat one."),
):
    """Expected tokens per forward, predicted speedup and the best draft length (Leviathan et al. 2023)."""
    from verispec import theory as th

    if k_max < 1:
        fail(f"--k-max must be >= 1, got {k_max}")
    curve = th.CostCurve.from_roofline(roofline_file) if roofline_file is not None else None
    if curve is not None and k_max + 1 > curve.ns[-1]:
        err.print(f"[yellow]note:[/] the roofline stops at N={curve.ns[-1]}; longer drafts are extrapolated")
    for a in alpha:
        table = Table(title=f"acceptance rate {a}, draft cost {cost} forwards per token"
                      + (f", verification cost from {roofline_file}" if curve else ", flat verification cost"))
        table.add_column("k", justify="right")
        table.add_column("E[tokens]/forward", justify="right")
        table.add_column("speedup (flat)", justify="right")
        if curve:
            table.add_column("T(k+1)/T(1)", justify="right")
            table.add_column("speedup (measured cost)", justify="right")
        for row in th.table(a, cost, k_max, curve):
            cells = [str(row.k), f"{row.expected_tokens:.3f}", f"{row.speedup_flat:.3f}"]
            if curve:
                cells += [f"{curve.ratio(row.k + 1):.3f}", f"{row.speedup_curve:.3f}"]
            table.add_row(*cells)
        out.print(table)
        k, s = th.optimal_k(a, cost, k_max=k_max)
        line = f"optimal k (flat): {k} -> {s:.2f}x"
        if curve:
            kc, sc = th.optimal_k(a, cost, curve, k_max=k_max)
            line += f"; optimal k (measured cost): {kc} -> {sc:.2f}x"
        out.print(line + ("" if s >= 1 else "  (speculation does not pay here)"))


def _csv(values: list[str]) -> list[str]:
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


@friendly
def bench(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Target model."),
    method: list[str] = typer.Option(["ar", "ngram"], "--method", help="Method, repeatable; options after a colon: 'ngram:draft_length=4,ngram_max=3,label=pld4'. Plain decoding (ar) always runs."),
    draft: Optional[str] = typer.Option(None, "--draft", help="Draft model for --method draft and the hf-assisted baseline."),
    draft_length: int = typer.Option(SpeculationSettings().draft_length, "--draft-length", "-k", help="Default draft length (also prompt_lookup_num_tokens for hf-pld)."),
    baselines: str = typer.Option("auto", "--baselines", help="Comma list of hf, hf-pld, hf-assisted, llamacpp, llamacpp-pld, openai:URL[,model=M,label=L] (any OpenAI-compatible server, same questions); 'auto' = all local ones that can run, 'none'."),
    prompts: str = typer.Option("spec_bench", "--prompts", "-p", help="spec_bench, mt_bench, gsm8k, humaneval or a JSONL file with 'turns'."),
    per_category: int = typer.Option(4, "--per-category", "-n", help="Questions per category (0 = all)."),
    categories: list[str] = typer.Option([], "--category", help="Only these categories (repeatable or comma list)."),
    group_tasks: bool = typer.Option(True, "--spec-bench-tasks/--all-categories", help="Group the 8 MT-Bench categories as one task (Spec-Bench's 6 tasks)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="New tokens per turn (cap)."),
    warmup: int = typer.Option(1, "--warmup", help="Untimed warm-up generations per contender."),
    prompt_mode: str = typer.Option("auto", "--prompt-mode", help="chat (tokenizer's chat template), raw, or auto."),
    roofline_file: Optional[Path] = typer.Option(None, "--roofline", help="Roofline JSON for predicted speedups with the measured verification cost."),
    dtype: str = typer.Option("float32", "--dtype"),
    weights: str = typer.Option("auto", "--weights", help=WEIGHTS_HELP),
    device: str = typer.Option("cpu", "--device"),
    threads: Optional[int] = typer.Option(None, "--threads"),
    seed: int = typer.Option(0, "--seed", help="Seed of the question sample."),
    output: Optional[Path] = typer.Option(None, "--out", "-o", help="JSON file (default results/MACHINE-KIND/bench/bench-MODEL-DTYPE.json); .md and PNGs go next to it."),
    plots: bool = typer.Option(True, "--plots/--no-plots"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
    batch_size: list[str] = typer.Option([], "--batch-size", "-B", help="Run the prompts through a batch of this many sequences with continuous admission (repeatable or comma list; 'sweep' = 1,2,4,8,16), instead of one at a time; every greedy output is checked against plain batch-1 decoding."),
    batch_positions: list[str] = typer.Option([], "--batch-positions", help="With --batch-size: the step's budget of verified positions across the batch, auto (from the measured cost curve), N or none (default); repeatable: each drafting method runs with each."),
):
    """Spec-Bench style benchmark: methods and baselines on the same prompts, speedups measured in the same run.
    With --batch-size: throughput and per-sequence latency of batched (continuous) decoding at each size."""
    from verispec.bench import prompts as pr
    from verispec.bench.baselines import BASELINES, OPENAI, parse_method, split_baselines
    from verispec.bench.harness import run_bench
    from verispec.bench.report import markdown, mismatch_lines, write_bench
    from verispec.models import load_model

    _threads(threads)
    if per_category < 0:
        fail(f"--per-category must be >= 0, got {per_category}")
    specs = [parse_method(m, draft_length) for m in method]
    for spec in specs:  # each contender's options are settings (verispec.options), checked before a model loads
        try:
            SpeculationSettings.of(method=spec.method, draft_length=spec.draft_length, **spec.options)
        except InvalidParameter as exc:
            fail(f"--method {spec.label}: {exc}")
    if any(s.method == "draft" for s in specs) and draft is None:
        fail("--method draft needs --draft MODEL")
    if baselines == "auto":
        # llama.cpp is always asked for: when it is not installed the result says "not run: ... (why)"
        names = ["hf", "hf-pld"] + (["hf-assisted"] if draft else []) + ["llamacpp", "llamacpp-pld"]
    elif baselines == "none":
        names = []
    else:
        names = split_baselines(baselines)
        unknown = [n for n in names if n not in BASELINES and not n.startswith(OPENAI)]
        if unknown:
            fail(f"unknown baseline {', '.join(unknown)}; use {', '.join(BASELINES)}, auto or none")
    if batch_positions and not batch_size:
        fail("--batch-positions needs --batch-size")
    sizes = settings = None
    if batch_size:
        from verispec.bench.batched import DEFAULT_BATCH_SIZES, parse_batch_sizes, parse_positions

        sizes = parse_batch_sizes([",".join(map(str, DEFAULT_BATCH_SIZES)) if v.strip().lower() == "sweep" else v
                                   for v in _csv(batch_size)])
        settings = [parse_positions(p) for p in _csv(batch_positions)] or [None]
        if baselines not in ("auto", "none"):
            fail("--baselines run one prompt at a time; they do not take --batch-size (use --baselines none)")
    questions = pr.load_prompts(prompts)
    if group_tasks:
        questions = pr.group_tasks(questions)
    questions = pr.sample(questions, per_category or None, seed=seed, only=_csv(categories) or None)
    target = load_model(model, dtype=dtype, device=device, weights=weights)
    draft_model = load_model(draft, dtype=target.dtype, device=target.device) if draft else None
    if sizes is not None:
        _bench_batched(target, specs, questions, draft_model, sizes, settings, max_new_tokens=max_new_tokens,
                       draft_length=draft_length, warmup=warmup, prompt_mode=prompt_mode, progress=progress,
                       threads=threads, prompt_set=prompts, model=model, output=output, plots=plots)
        return
    result = run_bench(target, specs, questions, draft=draft_model, baselines=names, max_new_tokens=max_new_tokens,
                       draft_length=draft_length, warmup=warmup, prompt_mode=prompt_mode, roofline=roofline_file,
                       progress=progress, threads=threads, prompt_set=prompts)
    path = output or _results_dir() / f"bench-{_slug(model)}-{result['config']['dtype']}.json"
    files = write_bench(result, path, plots=plots)
    md = markdown(result)
    out.print(md[md.index("## Overall"):md.index("## Per category")].strip(), markup=False)  # labels hold [..]
    out.print("wrote " + ", ".join(str(p) for p in files.values()))
    for name, why in (result["config"].get("skipped_contenders") or {}).items():
        err.print(f"not run: {name} ({why})", markup=False)
    bad = mismatch_lines(result)
    for line in bad:
        err.print(escape(line), style="bold red")
    if any(m["kind"] == "verispec" for m in result["mismatches"]):
        fail("a lossless method's greedy output differs from plain decoding (see above)", code=1)


def _bench_batched(target, specs, questions, draft_model, sizes, settings, *, model, output, plots, **kwargs):
    from verispec.bench.batched import run_batch_bench
    from verispec.bench.report import batch_markdown, batch_mismatch_lines, batch_table, write_batch_bench

    result = run_batch_bench(target, specs, questions, batch_sizes=sizes, positions=settings, draft=draft_model, **kwargs)
    path = output or _results_dir() / f"bench-batch-{_slug(model)}-{result['config']['dtype']}.json"
    files = write_batch_bench(result, path, plots=plots)
    md = batch_markdown(result)
    out.print(md[md.index("- plain, unbatched"):md.index("- speedup:")].strip(), markup=False)
    out.print(batch_table(result), markup=False)  # labels hold [..]
    out.print("wrote " + ", ".join(str(p) for p in files.values()))
    for line in batch_mismatch_lines(result):
        err.print(escape(line), style="bold red")
    if result["mismatches"]:
        fail("a batched greedy output differs from plain batch-1 decoding (see above)", code=1)


def _results_dir() -> Path:
    """Where a run's files go unless --out says: results/<machine-kind>/bench/ (results/README.md)."""
    from verispec.bench.environment import machine_kind

    return Path("results") / machine_kind() / "bench"


@friendly
def report(
    files: list[Path] = typer.Argument(..., help="Bench and/or roofline JSON files."),
    output: Optional[Path] = typer.Option(None, "--out", "-o", help="Folder for compare.md and the comparison plots."),
):
    """Render one or several result files side by side (table, and plots with --out)."""
    from verispec.bench.report import compare

    text, written = compare(files, output)
    out.print(text, markup=False)
    if written:
        out.print("wrote " + ", ".join(str(p) for p in written.values()))
