#!/usr/bin/env python
"""Roofline + a short Spec-Bench run on one GPU, in under 8 minutes, needing only this repository.

    python -m benchmarks.gpu_bench                 # on a CUDA machine: writes results/<machine-kind>/bench/
    python -m benchmarks.gpu_bench --dry-run       # same steps on the CPU with tiny sizes, into a temp folder

What it runs (all greedy, batch 1):
  1. roofline of the target in bfloat16 and float32 (N = 1..256 over a 200-token context, median of 20
     after 5 warm-up forwards, torch.cuda.synchronize around each);
  2. bench in bfloat16: Spec-Bench public split, 1 question per task (6 tasks, MT-Bench 2 turns), 128 new
     tokens per turn: ar, ngram, draft (the target drafting for itself: a validation of the draft path,
     not a speed claim, since no smaller same-vocabulary model ships), with the transformers baselines
     hf, hf-pld and hf-assisted, and the bfloat16 roofline for predicted speedups;
  3. compare.md + plots of everything.
No network is needed: the model comes from the embedded package cache. If the embedded model cannot be
loaded there, the roofline still runs on a random-weight model of the same shapes (time does not depend on
weight values) and the bench is skipped; the results say so.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def smollm2_shaped_random(dtype, device):
    """A random Llama with SmolLM2-135M's shapes (its config.json values), built without any download."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from verispec.models.loader import from_model

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rope_theta=100000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dtype=dtype, device=device).eval()
    return from_model(model, tokenizer=None, name="random-smollm2-shape")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default=None, help="results folder (default results/<machine-kind>/bench, e.g. results/h100/bench; --dry-run: a temp folder)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: checks the script end to end")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--method", action="append", default=None, help="extra/other verispec methods (repeatable)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip later steps past this many seconds")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (dry run: 1)")
    args = ap.parse_args()

    import torch

    if args.threads or args.dry_run:
        torch.set_num_threads(args.threads or 1)

    from verispec.bench import prompts as pr
    from verispec.bench import roofline as rl
    from verispec.bench.environment import environment, machine_kind
    from verispec.bench.harness import run_bench
    from verispec.bench.report import compare, plot_roofline, write_bench, write_json
    from verispec.errors import VerispecError
    from verispec.models import load_model

    t_start = time.perf_counter()
    if args.dry_run:
        device, ns, repeats, warmup, context = "cpu", rl.default_ns(8), 2, 1, 32
        max_new, cats = min(args.max_new_tokens, 8), ["qa", "mt_bench"]
        import tempfile

        out = Path(args.out or tempfile.mkdtemp(prefix="verispec-gpu-dryrun-"))  # never mixed into results/
    else:
        if not torch.cuda.is_available():
            print("no CUDA GPU here; use --dry-run to check the script on the CPU", file=sys.stderr)
            return 2
        device, ns, repeats, warmup, context = "cuda", rl.default_ns(256), 20, 5, 200
        max_new, cats = args.max_new_tokens, None
        out = Path(args.out or ROOT / "results" / machine_kind() / "bench")
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    notes: dict = {"dry_run": args.dry_run, "device": device}

    def elapsed() -> float:
        return time.perf_counter() - t_start

    # 1. roofline in bfloat16 and float32
    roof_bf16 = None
    for dtype in ("bfloat16", "float32"):
        if elapsed() > args.budget_s:
            notes[f"roofline_{dtype}"] = "skipped: time budget spent"
            continue
        try:
            target = load_model(args.model, dtype=dtype, device=device)
        except VerispecError as exc:
            notes["model_fallback"] = f"{args.model} not loadable ({exc}); roofline on random weights of SmolLM2-135M's shapes"
            target = smollm2_shaped_random(getattr(torch, dtype), device)
        res = rl.measure(target, context=context, ns=ns, repeats=repeats, warmup=warmup)
        res["environment"] = environment(target)
        name = f"roofline-{target.name}-{dtype}-{device}"
        written.append(write_json(res, out / f"{name}.json"))
        written.append(plot_roofline(res, out / f"{name}.png"))
        print(rl.format_table(res), flush=True)
        if dtype == "bfloat16":
            roof_bf16 = out / f"{name}.json"
        del target
        if device == "cuda":
            torch.cuda.empty_cache()

    # 2. a short bench in bfloat16
    if "model_fallback" in notes:
        notes["bench"] = "skipped: the real model is needed for meaningful acceptance"
    elif elapsed() > args.budget_s:
        notes["bench"] = "skipped: time budget spent"
    else:
        target = load_model(args.model, dtype="bfloat16", device=device)
        draft = load_model(args.model, dtype="bfloat16", device=device)  # its own draft: validation only
        questions = pr.sample(pr.group_tasks(pr.load_prompts("spec_bench")), args.per_category, seed=0, only=cats)
        methods = args.method or ["ar", "ngram", "draft:draft_length=4"]
        res = run_bench(target, methods, questions, draft=draft, baselines=["hf", "hf-pld", "hf-assisted"],
                        max_new_tokens=max_new, roofline=roof_bf16, prompt_set="spec_bench", progress=True)
        res["config"]["note"] = ("draft = the target itself (no smaller same-vocabulary model ships): validates the "
                                 "draft-model path and its bookkeeping, not a speedup claim")
        files = write_bench(res, out / f"bench-{args.model}-bfloat16-{device}.json")
        written += list(files.values())
        bad = [m for m in res["mismatches"] if m["kind"] == "verispec"]
        notes["verispec_mismatches"] = len(bad)
        if bad:
            print(f"!!! {len(bad)} GREEDY MISMATCHES of lossless methods against plain decoding: see {files['markdown']}",
                  file=sys.stderr)

    # 3. everything side by side
    jsons = [p for p in written if p.suffix == ".json"]
    if jsons:
        text, _ = compare(jsons, out)
        print(text)
    notes["elapsed_s"] = round(elapsed(), 1)
    write_json(notes, out / "run_notes.json")
    print(f"done in {elapsed():.0f} s; results in {out}")
    return 1 if notes.get("verispec_mismatches") else 0


if __name__ == "__main__":
    sys.exit(main())
