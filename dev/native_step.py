"""What the native layer step (verispec/fast/native.py) saves: one forward over n new positions after a
200-token context, Python step against native step, per weights format, exact mode and not, side by
side in rounds (medians), each against the floor of its format's weight bytes over the copy bandwidth
measured at the start of the same round. Exact mode runs both attentions: attend.py's kernel and
canonical.py's PyTorch operations (rows "attention": "ops").

    python -m dev.native_step --threads 1 --json results/xeon/kernels/native_step_amx_1thread.json
"""

from __future__ import annotations

import statistics
import time

import torch
from verispec.bench.script import options, parse, write_json


def main() -> None:
    ap = options(__doc__, model="smollm2-135m", threads=1, json=None)
    ap.add_argument("--weights", nargs="+", default=["bf16", "q4"])
    ap.add_argument("--positions", nargs="+", type=int, default=[1, 8, 16])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    args = parse(ap)

    from verispec.bench.environment import environment
    from verispec.bench.roofline import copy_bandwidth
    from verispec.backends.fast import FastRunner
    from verispec.fast import attend, native
    from verispec.models import load_model

    print("native step:", native.status())
    target = load_model(args.model, dtype="bfloat16")
    ids = target.encode(prompt="The history of the printing press begins in the fifteenth century, when")
    ctx = (ids * 200)[:200]
    kernel_runs_on = attend.runs_on
    runners = {}
    for fmt in args.weights:
        for exact in (True, False):
            for use in (False, True):
                kinds = (("kernel", "ops") if attend.available() is None else ("ops",)) if exact else ("sdpa",)
                for att in kinds:
                    r = FastRunner(target.model, exact=exact, weights=fmt, weight_source=target.weight_source, native=use)
                    r.forward(ctx, last_only=True)
                    runners[(fmt, exact, use, att)] = r
    seen = {k: [] for k in runners}
    bws = []
    for _ in range(args.rounds):
        bws.append(copy_bandwidth(torch.device("cpu"))["gb_per_s"] * 1e9)
        for key, r in runners.items():
            attend.runs_on = (lambda t: False) if key[3] == "ops" else kernel_runs_on
            got = {}
            for n in args.positions:
                r.forward(ctx[:n])
                r.rollback(200)
                ts = []
                for _ in range(args.repeat):
                    t = time.perf_counter()
                    r.forward(ctx[:n])
                    r.rollback(200)
                    ts.append(time.perf_counter() - t)
                got[n] = statistics.median(ts)
            seen[key].append(got)
    attend.runs_on = kernel_runs_on
    rows = []
    n1 = min(args.positions)
    print(f"ms per forward, {torch.get_num_threads()} thread(s), copy bandwidth {statistics.median(bws) / 1e9:.1f} GB/s (median of rounds)")
    for (fmt, exact, use, att), got in seen.items():
        nbytes = runners[(fmt, exact, use, att)].net.streamed_bytes()
        ms = {n: statistics.median(g[n] for g in got) * 1e3 for n in args.positions}
        over = statistics.median(g[n1] / (nbytes / b) for g, b in zip(got, bws))
        rows.append({"weights": fmt, "exact": exact, "step": "native" if use else "python", "attention": att, "ms": ms,
                     "weight_bytes": nbytes, "fwd1_over_floor": over})
        print(f"{fmt:5s} {'exact' if exact else 'not exact':9s} {'native' if use else 'python':6s} {att:6s} "
              + "  ".join(f"{n} pos {v:7.1f}" for n, v in ms.items()) + f"  | {n1} pos = {over:.2f}x the floor")
    if args.json:
        write_json({"environment": environment(), "rows": rows, "copy_bandwidth_rounds": bws,
                    "native": native.status()}, args.json)


if __name__ == "__main__":
    main()
