"""Where a quantized format's passes should switch to the dense copy of its weights (quant.wide_rows).

For each format, one forward over n new positions after a 200-token context, outside exact mode, on the
weight-only kernels (wide=False) and on the dense packed bf16 weights (what the dense copy runs), side by
side in rounds (medians), plus a 256-token prefill with and without the dense copy. The smallest n from
which the dense forward is the faster is printed per format.

    python benchmarks/wide_rows.py --threads 1 --json results/cpu/wide_rows_amx_1thread.json
"""

from __future__ import annotations

import statistics
import time

import torch
from _common import options, parse, write_json


def timed(fn, repeat: int) -> float:
    fn()
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    ap = options(__doc__, model="smollm2-135m", threads=1, json=None)
    ap.add_argument("--formats", nargs="+", default=["q4", "q8"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 6, 8, 12, 16, 32])
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    args = parse(ap)

    from verispec.backends.fast import FastRunner
    from verispec.bench.environment import environment
    from verispec.models import load_model

    target = load_model(args.model, dtype="bfloat16")
    ids = target.encode(prompt="The history of the printing press begins in the fifteenth century, when")
    ctx = (ids * 400)[:max(200, args.prefill)]
    runners = {"bf16": FastRunner(target.model, exact=False, weights="bf16")}
    for fmt in args.formats:
        runners[fmt] = FastRunner(target.model, exact=False, weights=fmt, weight_source=target.weight_source, wide=False)
        runners[f"{fmt}+dense copy"] = FastRunner(target.model, exact=False, weights=fmt,
                                                  weight_source=target.weight_source)
    seen: dict[str, list[dict]] = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, r in runners.items():
            got = {}
            r.reset()
            got["prefill_ms"] = timed(lambda: (r.reset(), r.forward(ctx[:args.prefill], last_only=True).logits), 1) * 1e3
            r.reset()
            r.forward(ctx[:200], last_only=True)
            for n in args.rows:
                got[n] = timed(lambda: (r.forward(ctx[:n]).logits, r.rollback(200)), args.repeat) * 1e3
            seen[name].append(got)
    table = {name: {k: statistics.median(g[k] for g in got) for k in got[0]} for name, got in seen.items()}
    print(f"ms per forward over n new positions (not exact), {torch.get_num_threads()} thread(s)")
    print(f"{'':16s}" + "".join(f"{n:>8d}" for n in args.rows) + f"{'prefill ' + str(args.prefill):>14s}")
    for name, t in table.items():
        print(f"{name:16s}" + "".join(f"{t[n]:8.1f}" for n in args.rows) + f"{t['prefill_ms']:14.1f}")
    crossover = {fmt: next((n for n in args.rows if table["bf16"][n] <= table[fmt][n]), None) for fmt in args.formats}
    print("dense copy faster from n =", crossover)
    if args.json:
        write_json({"environment": environment(), "ms": table, "crossover_rows": crossover, "rounds": args.rounds},
                   args.json)


if __name__ == "__main__":
    main()
