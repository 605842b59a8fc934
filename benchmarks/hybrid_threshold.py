"""The hybrid drafter's threshold (drafters/hybrid.py: the least expected accepted tokens for which the suffix
tries' tree is taken instead of the trained drafter's), chosen on prompts no bench asks and no head trained
on: the held-out records of a training work folder (train/data.split_heldout: 5% of every source's
answers, never trained on). Plain decoding, suffix decoding and the hybrid at each threshold answer every
prompt in a rotating order, each with a suffix cache of its own kept across the prompts; tokens/s over the
prompts (prefill included), mean accepted length, and a check that every output equals plain decoding's.

    python benchmarks/hybrid_threshold.py --work .verispec-train/v8 --per-source 10 --threads 2 \
        --json results/zen4/heads/hybrid_threshold_heldout_2threads_zen4.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from _common import options, parse, write_json


def main() -> None:
    ap = options(__doc__, model="smollm2-135m", dtype="bfloat16", threads=None, json=None)
    ap.add_argument("--work", default=".verispec-train/v8", help="training work folder with answers.jsonl")
    ap.add_argument("--per-source", type=int, default=10, help="held-out records per source")
    ap.add_argument("--method", default="suffix+eagle", help="the hybrid method")
    ap.add_argument("--scores", nargs="+", type=float, default=[0.25, 0.5, 1.0])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = parse(ap)

    from verispec.api import build_engine
    from verispec.bench.environment import environment
    from verispec.drafters.suffix import SuffixCache
    from verispec.models import load_model
    from verispec.train.data import split_heldout
    from verispec.types import SamplingParams

    records = [json.loads(line) for line in Path(args.work, "answers.jsonl").read_text().splitlines() if line.strip()]
    _, held = split_heldout(records, 0.05)
    sources = sorted({r["source"] for r in held})
    prompts = [r["prompt_ids"] for s in sources for r in [h for h in held if h["source"] == s][:args.per_source]]
    target = load_model(args.model, dtype=args.dtype)
    engines = {"ar": build_engine(target, "ar"),
               "suffix": build_engine(target, "suffix", tree="dynamic", suffix_cache=SuffixCache())}
    for score in args.scores:
        engine = build_engine(target, args.method, tree="dynamic", suffix_cache=SuffixCache())
        engine.drafter.min_score = score
        engines[f"{args.method}@{score}"] = engine
    for engine in engines.values():  # untimed warm-up; its answer is not for the caches
        engine.generate(prompts[0][:40], SamplingParams(max_new_tokens=8))
        if engine.drafter is not None and hasattr(engine.drafter, "forget"):
            engine.drafter.forget()
    names = list(engines)
    tokens, seconds, steps, equal = ({k: 0 for k in names} for _ in range(4))
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    for i, prompt in enumerate(prompts):
        outs = {}
        for name in names[i % len(names):] + names[:i % len(names)]:
            t = time.perf_counter()
            gen = engines[name].generate(prompt, params)
            seconds[name] += time.perf_counter() - t
            tokens[name] += len(gen.token_ids)
            steps[name] += gen.stats.steps
            outs[name] = gen.token_ids
        for name in names:
            equal[name] += outs[name] == outs["ar"]
    base = tokens["ar"] / seconds["ar"]
    rows = []
    for name in names:
        rate = tokens[name] / seconds[name]
        rows.append({"config": name, "tokens_per_second": rate, "speedup": rate / base, "tau": tokens[name] / steps[name],
                     "equal_to_plain": f"{equal[name]}/{len(prompts)}"})
        print(f"{name:22s} {rate:7.1f} tok/s  {rate / base:.3f}x  tau {tokens[name] / steps[name]:.2f}  "
              f"= plain {equal[name]}/{len(prompts)}")
    if args.json:
        write_json({"environment": environment(target), "sources": sources, "prompts": len(prompts), "rows": rows},
                   args.json)


if __name__ == "__main__":
    main()
