"""Turn benchmark and roofline results into files people read: JSON, a markdown table, PNG plots, for
each kind of result (bench/harness.py's, bench/batched.py's, bench/roofline.py's); the benches only run.

Plots are drawn with matplotlib's Agg backend (no display needed). One result or several side by side
(`verispec report a.json b.json`) to compare runs and machines.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from verispec.errors import InvalidParameter


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def _fmt(v, spec: str = ".2f", none: str = "-") -> str:
    if v is None:
        return none
    return format(v, spec)


# ---------------------------------------------------------------- loading


def load_result(path: str | Path) -> dict:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise InvalidParameter(f"{path} is not a JSON file ({exc.msg})") from exc
    if not isinstance(data, dict) or not str(data.get("schema", "")).startswith(("verispec-bench/", "verispec-bench-batch/", "verispec-roofline/")):
        raise InvalidParameter(f"{path} is not a verispec bench or roofline result")
    return data


def command_line() -> str:
    """This process's command line as one would type it again: `verispec ...`, `python -m module ...` (the
    scripts in benchmarks/ and dev/) or `python script ...`."""
    head = sys.argv[0]
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if Path(head).name in ("verispec", "__main__.py"):
        words = ["verispec"]
    elif spec is not None and spec.name:
        words = ["python", "-m", spec.name]
    else:
        words = ["python", head]
    return shlex.join(words + sys.argv[1:])


def write_json(data: dict, path: str | Path) -> Path:
    """Write a result; it carries the command line that produced it (figures live in results/ as JSON +
    the command), unless it names its command itself."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"command": command_line(), **data}, indent=1) + "\n")
    return path


# ---------------------------------------------------------------- bench: one result


def mismatch_lines(result: dict) -> list[str]:
    lines = []
    for m in result.get("mismatches", []):
        what = ("LOSSLESS METHOD DIFFERS FROM PLAIN DECODING" if m["kind"] == "verispec"
                else "baseline output differs from verispec plain decoding")
        lines.append(f"GREEDY MISMATCH ({what}): {m['method']} on question {m['question_id']} ({m['category']}), "
                     f"turn {m['turn'] + 1}, first different token at {m['first_difference_at']}")
    return lines


def markdown(result: dict) -> str:
    cfg, env = result["config"], result["environment"]
    hw = env.get("gpu") or env.get("cpu")
    out = [f"# verispec bench: {cfg['model']} ({cfg['dtype']}, {cfg['device']})", "",
           f"- prompts: {cfg['prompt_set'] or 'custom'} ({len(result['questions'])} questions, {cfg['prompt_mode']} mode), "
           f"greedy, batch 1, max {cfg['max_new_tokens']} new tokens per turn, draft length {cfg['draft_length']}"
           + (f", draft model {cfg['draft']}" if cfg.get("draft") else ""),
           f"- machine: {hw}, {env.get('torch_threads')} torch threads (kernels on {env.get('kernel_threads')}); torch {env['torch']}, "
           f"transformers {env['transformers']}, verispec {env.get('verispec')} ({env.get('git_commit')}), {env['time_utc']}",
           "- speedup: tokens/s over plain decoding (ar) measured in the same run on the same questions, prefill "
           "included; decode speedup: the same without each turn's prefill (the same work for every method, which "
           "speculation cannot shorten; with short answers and long prompts it is much of the time); "
           "tau: tokens per target forward; alpha: accepted / drafted; predicted: tau / (k c + 1) (flat) or "
           "with the roofline's verification cost (curve)"]
    for name, why in (cfg.get("skipped_contenders") or {}).items():
        out.append(f"- not run: {name} ({why})")
    if cfg.get("skipped_questions"):
        out.append(f"- skipped {len(cfg['skipped_questions'])} questions too long for the context window")
    mism = mismatch_lines(result)
    if mism:
        out += ["", "## !!! GREEDY OUTPUT MISMATCHES !!!", ""] + [f"- **{m}**" for m in mism]
    out += ["", "## Overall", "", _table(result, overall_only=True), "", "## Per category", "", _table(result, overall_only=False)]
    return "\n".join(out) + "\n"


def _table(result: dict, overall_only: bool) -> str:
    head = ["method", "category", "questions", "tok/s", "speedup", "decode speedup", "tau", "alpha", "draft share",
            "predicted (flat)", "predicted (curve)", "= plain"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, entry in result["summary"].items():
        groups = [("overall", entry["overall"])] if overall_only else list(entry["categories"].items())
        for cat, a in groups:
            rows.append("| " + " | ".join([
                label, cat, str(a["questions"]), _fmt(a["tokens_per_second"], ".1f"), _fmt(a.get("speedup"), ".2f") + "x",
                _fmt(a.get("decode_speedup"), ".2f") + ("x" if a.get("decode_speedup") is not None else ""),
                _fmt(a.get("mean_accepted_length")), _fmt(a.get("acceptance_rate")),
                _fmt(a.get("draft_share"), ".0%") if a.get("draft_share") is not None else "-",
                _fmt(a.get("predicted_speedup_flat")), _fmt(a.get("predicted_speedup_curve")),
                f"{a['matches_plain']}/{a['questions']}",
            ]) + " |")
    return "\n".join(rows)


def plot_speedup(result: dict, path: Path) -> Path:
    summary = result["summary"]
    labels = [m for m in summary if m != "ar"]
    cats = list(next(iter(summary.values()))["categories"]) + ["overall"]
    fig, ax = _plt().subplots(figsize=(max(6, 1.1 * len(cats) * max(1, len(labels)) * 0.45 + 3), 4.5))
    width = 0.8 / max(1, len(labels))
    for i, m in enumerate(labels):
        vals = [(summary[m]["categories"].get(c) if c != "overall" else summary[m]["overall"]) or {} for c in cats]
        ys = [v.get("speedup") or 0.0 for v in vals]
        ax.bar([x + (i - (len(labels) - 1) / 2) * width for x in range(len(cats))], ys, width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(cats)))
    ax.set_xticklabels(cats, rotation=30, ha="right")
    ax.set_ylabel("speedup over plain decoding (same run)")
    ax.set_title(f"{result['config']['model']} ({result['config']['dtype']}): speedup per category")
    if labels:
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_acceptance(result: dict, path: Path) -> Path:
    fig, ax = _plt().subplots(figsize=(6, 4))
    drawn = 0
    for m, entry in result["summary"].items():
        acc = entry["overall"].get("acceptance_by_position") or []
        if acc and entry["overall"].get("drafted"):
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=m)
            drawn += 1
    ax.set_xlabel("draft position")
    ax.set_ylabel("share of steps accepting this position")
    ax.set_ylim(0, 1.05)
    ax.set_title("acceptance by position")
    if drawn:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no drafted tokens", ha="center", transform=ax.transAxes)
    return _save(fig, path)


def plot_throughput(result: dict, path: Path) -> Path:
    summary = result["summary"]
    labels = list(summary)
    tps = [summary[m]["overall"]["tokens_per_second"] for m in labels]
    colors = ["tab:gray" if m == "ar" else ("tab:orange" if summary[m]["kind"] == "baseline" else "tab:blue") for m in labels]
    fig, ax = _plt().subplots(figsize=(max(5, 0.9 * len(labels) + 2), 4))
    bars = ax.bar(range(len(labels)), tps, color=colors)
    for b, v in zip(bars, tps):
        ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right")
    ax.set_ylabel("tokens / s (overall)")
    ax.set_title("throughput: verispec (blue), plain (gray), baselines (orange)")
    return _save(fig, path)


def write_json_and_markdown(result: dict, json_path: Path, table: str) -> dict[str, Path]:
    """The result's JSON (with the command line) and its markdown table next to it (.md)."""
    md = json_path.with_suffix(".md")
    md.write_text(table)
    return {"json": write_json(result, json_path), "markdown": md}


def write_bench(result: dict, json_path: str | Path, plots: bool = True) -> dict[str, Path]:
    """Write the JSON, the markdown table next to it (.md) and the plots (<stem>_*.png)."""
    json_path = Path(json_path)
    files = write_json_and_markdown(result, json_path, markdown(result))
    if plots:
        stem = json_path.with_suffix("")
        files["speedup_png"] = plot_speedup(result, Path(f"{stem}_speedup.png"))
        files["acceptance_png"] = plot_acceptance(result, Path(f"{stem}_acceptance.png"))
        files["throughput_png"] = plot_throughput(result, Path(f"{stem}_throughput.png"))
    return files


# ---------------------------------------------------------------- batched bench (bench/batched.py)


def batch_mismatch_lines(result: dict) -> list[str]:
    return [f"GREEDY MISMATCH (BATCHED OUTPUT DIFFERS FROM PLAIN BATCH-1 DECODING): {m['method']} at batch size "
            f"{m['batch_size']} on question {m['question_id']} ({m['category']}), turn {m['turn'] + 1}, first different "
            f"token at {m['first_difference_at']}" for m in result.get("mismatches", [])]


def batch_table(result: dict) -> str:
    head = ["method", "B", "positions", "tok/s", "speedup", "latency p50 s", "latency p95 s", "ms/token p50",
            "ms/token p95", "tau", "occupancy", "positions/step", "load", "= plain"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in result["entries"]:
        s = e["summary"]
        load = e.get("load_average") or [None, None]
        rows.append("| " + " | ".join([
            e["label"], str(e["batch_size"]), "-" if e["positions"] is None else str(e["positions"]),
            _fmt(s["tokens_per_second"], ".1f"), _fmt(s.get("speedup")) + "x",
            _fmt(s["latency_p50_s"]), _fmt(s["latency_p95_s"]),
            _fmt(s["time_per_token_p50_s"] and s["time_per_token_p50_s"] * 1e3, ".0f"),
            _fmt(s["time_per_token_p95_s"] and s["time_per_token_p95_s"] * 1e3, ".0f"),
            _fmt(s["mean_accepted_length"]), _fmt(s["mean_occupancy"], ".1f"), _fmt(s["positions_per_step"], ".1f"),
            "/".join(_fmt(x, ".1f") for x in load), f"{s['matches_plain']}/{s['questions']}",
        ]) + " |")
    return "\n".join(rows)


def batch_markdown(result: dict) -> str:
    cfg, env, ref = result["config"], result["environment"], result["reference"]
    hw = env.get("gpu") or env.get("cpu")
    out = [f"# verispec bench --batch-size: {cfg['model']} ({cfg['dtype']}, {cfg['device']})", "",
           f"- prompts: {cfg['prompt_set'] or 'custom'} ({len(result['questions'])} questions, "
           f"{len(ref['sequences'])} turns, {cfg['prompt_mode']} mode), greedy, max {cfg['max_new_tokens']} new tokens "
           f"per turn, draft length {cfg['draft_length']}, continuous admission (all prompts queued at the start)",
           f"- machine: {hw}, {env.get('torch_threads')} torch threads, {env.get('cpu_count')} CPUs; torch {env['torch']}, "
           f"verispec {env.get('verispec')} ({env.get('git_commit')}), {env['time_utc']}",
           f"- positions budget auto = {cfg['positions_resolved']} at B=1, chosen each step at the batch's size (batch.free_positions of the measured cost curve)"
           if cfg.get("positions_resolved") else "- positions budget: none unless the row says",
           f"- plain, unbatched (Engine.generate, one prompt at a time): {ref['tokens_per_second']:.1f} tok/s",
           "- speedup: aggregate tokens/s over ar at B=1 in the same run; latency: admission (prefill included) "
           "to last token; tau: tokens per target forward per sequence; occupancy: mean sequences per shared "
           "forward; load: 1-minute load average before/after the row"]
    if cfg.get("skipped_questions"):
        out.append(f"- skipped {len(cfg['skipped_questions'])} questions too long for the context window")
    mism = batch_mismatch_lines(result)
    if mism:
        out += ["", "## !!! GREEDY OUTPUT MISMATCHES !!!", ""] + [f"- **{m}**" for m in mism]
    out += ["", "## By batch size", "", batch_table(result)]
    return "\n".join(out) + "\n"


def plot_batch(result: dict, path) -> Path:
    """Aggregate tokens/s and p50 latency against the batch size, one line per contender."""
    fig, (ax, ax2) = _plt().subplots(1, 2, figsize=(11, 4.2))
    for label in dict.fromkeys(e["label"] for e in result["entries"]):
        mine = [e for e in result["entries"] if e["label"] == label]
        bs = [e["batch_size"] for e in mine]
        ax.plot(bs, [e["summary"]["tokens_per_second"] for e in mine], marker="o", label=label)
        ax2.plot(bs, [e["summary"]["latency_p50_s"] or 0.0 for e in mine], marker="o", label=label)
    for a, y in ((ax, "aggregate tokens / s"), (ax2, "per-sequence latency p50 (s)")):
        a.set_xscale("log", base=2)
        a.set_xlabel("batch size B")
        a.set_ylabel(y)
        a.legend(fontsize=8)
    ax.set_title(f"{result['config']['model']} ({result['config']['dtype']}): continuous batching")
    return _save(fig, Path(path))


def write_batch_bench(result: dict, json_path, plots: bool = True) -> dict:
    """Write the JSON (with the command line), the markdown table next to it (.md) and, with plots, <stem>_batch.png."""
    json_path = Path(json_path)
    files = write_json_and_markdown(result, json_path, batch_markdown(result))
    if plots:
        files["batch_png"] = plot_batch(result, Path(f"{json_path.with_suffix('')}_batch.png"))
    return files


# ---------------------------------------------------------------- roofline


def plot_roofline(result: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ns = [p["n"] for p in result["points"]]
    ms = [p["median_s"] * 1e3 for p in result["points"]]
    fig, (ax, ax2) = _plt().subplots(1, 2, figsize=(11, 4.2))
    ax.plot(ns, ms, marker="o", label="measured forward (median)")
    ax.axhline(result["floor_s"] * 1e3, color="tab:red", linestyle="--", label="bandwidth floor (weights / copy bw)")
    ax.axhline(result["t1_s"] * 1e3 * result["free_factor"], color="tab:gray", linestyle=":",
               label=f"{result['free_factor']}x N=1")
    ax.axvline(result["free_positions"], color="tab:green", linestyle=":", label=f"free positions: {result['free_positions']}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("new positions N in one forward")
    ax.set_ylabel("ms per forward")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title(f"{result['model']} ({result['dtype']}, {result['device']}), context {result['context']}")
    ax2.plot(ns, [m / n for m, n in zip(ms, ns)], marker="o", color="tab:purple")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("new positions N in one forward")
    ax2.set_ylabel("ms per position")
    ax2.set_title("cost per scored position")
    return _save(fig, path)


# ---------------------------------------------------------------- several results side by side


def _run_name(path: Path, data: dict) -> str:
    env = data.get("environment", {})
    hw = env.get("gpu") or env.get("cpu") or "?"
    return f"{path.stem} [{hw}, {data['config']['dtype']}]"


def compare(paths: list[str | Path], out_dir: str | Path | None = None) -> tuple[str, dict[str, Path]]:
    """Markdown comparing several bench results (and roofline results), plus plots when out_dir is given."""
    if not paths:
        raise InvalidParameter("give at least one result file")
    benches, roofs, batches = [], [], []
    for p in paths:
        data = load_result(p)
        schema = data["schema"]
        (benches if schema.startswith("verispec-bench/") else batches if schema.startswith("verispec-bench-batch/")
         else roofs).append((Path(p), data))
    lines = ["# verispec results side by side", ""]
    if batches:
        for p, d in batches:
            lines += [f"## Batched: {_run_name(p, d)}", "", batch_table(d), ""]
            lines += [f"**{p.name}: {m}**" for m in batch_mismatch_lines(d)]
    if benches:
        lines += ["## Bench (overall)", "",
                  "| run | model | method | questions | tok/s | speedup | decode speedup | tau | alpha | = plain | mismatches |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for p, d in benches:
            nm = {}
            for m in d.get("mismatches", []):
                nm[m["method"]] = nm.get(m["method"], 0) + 1
            for label, entry in d["summary"].items():
                a = entry["overall"]
                lines.append(f"| {_run_name(p, d)} | {d['config']['model']} | {label} | {a['questions']} | "
                             f"{a['tokens_per_second']:.1f} | {_fmt(a.get('speedup'))}x | {_fmt(a.get('decode_speedup'))}x | "
                             f"{_fmt(a.get('mean_accepted_length'))} | "
                             f"{_fmt(a.get('acceptance_rate'))} | {a['matches_plain']}/{a['questions']} | "
                             f"{'**' + str(nm[label]) + '**' if nm.get(label) else 0} |")
        for p, d in benches:
            for m in mismatch_lines(d):
                lines.append(f"\n**{p.name}: {m}**")
    if roofs:
        lines += ["", "## Roofline", "", "| run | model | dtype | device | N=1 ms | floor ms | x floor | free positions | "
                  + " | ".join(f"N={p['n']}" for p in roofs[0][1]["points"]) + " |",
                  "|" + "---|" * (8 + len(roofs[0][1]["points"]))]
        for p, d in roofs:
            by_n = {pt["n"]: pt for pt in d["points"]}
            cells = [f"{by_n[pt['n']]['ratio']:.2f}x" if pt["n"] in by_n else "-" for pt in roofs[0][1]["points"]]
            lines.append(f"| {p.stem} | {d['model']} | {d['dtype']} | {d['device']} | {d['t1_s'] * 1e3:.2f} | "
                         f"{d['floor_s'] * 1e3:.2f} | {d['floor_ratio']:.1f} | {d['free_positions']} | " + " | ".join(cells) + " |")
    files: dict[str, Path] = {}
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        plt = _plt()
        if benches:
            runs = [_run_name(p, d) for p, d in benches]
            methods = list(dict.fromkeys(m for _, d in benches for m in d["summary"]))
            fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
            width = 0.8 / len(benches)
            for key, ax, ylabel in (("speedup", axes[0], "overall speedup over plain (same run)"),
                                    ("tokens_per_second", axes[1], "tokens / s (overall)")):
                for i, ((p, d), run) in enumerate(zip(benches, runs)):
                    ys = [(d["summary"].get(m, {}).get("overall", {}).get(key) or 0.0) for m in methods]
                    ax.bar([x + (i - (len(benches) - 1) / 2) * width for x in range(len(methods))], ys, width, label=run)
                ax.set_xticks(range(len(methods)))
                ax.set_xticklabels(methods, rotation=30, ha="right")
                ax.set_ylabel(ylabel)
                if key == "speedup":
                    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
            axes[0].legend(fontsize=7)
            files["bench_png"] = _save(fig, out / "compare_bench.png")
        if roofs:
            fig, ax = plt.subplots(figsize=(6.5, 4.2))
            for p, d in roofs:
                ax.plot([pt["n"] for pt in d["points"]], [pt["ratio"] for pt in d["points"]], marker="o",
                        label=f"{p.stem} ({d['dtype']}, {d['device']})")
            ax.axhline(1.25, color="tab:gray", linestyle=":")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("new positions N")
            ax.set_ylabel("forward time / N=1 time")
            ax.legend(fontsize=7)
            files["roofline_png"] = _save(fig, out / "compare_roofline.png")
        md = out / "compare.md"
        md.write_text("\n".join(lines) + "\n")
        files["markdown"] = md
    return "\n".join(lines) + "\n", files
