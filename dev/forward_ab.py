"""One forward of two checkouts side by side: the fast path's exact-mode forward over n new positions after
a context (200 tokens unless --context), each tree in its own worker process, alternated round by round.

For a change to the forward (a kernel, a fused operation) whose effect is a few percent: end-to-end
generations (compare_checkouts.py) carry prefill, drafting and the engine, and a shared VM's speed drifts
by more than that between two separate runs. Here both trees time the same forward in the same minutes,
and the figure is the median over rounds of the after/before ratio of each round. A process's speed also
depends on where its weights landed in memory, so each tree runs in several processes (`--workers`) and a
round's time is their mean. Running a tree against itself (`--before . --after .`) shows the noise of the
harness. Each tree builds its C++ operators in a
folder of its own (compare_checkouts.extensions_dir).

    python -m dev.forward_ab --before /tmp/wt-before --after . --positions 1 8 --rounds 12 \
        --json results/<machine-kind>/kernels/forward_ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from dev.compare_checkouts import imported_from, launch, tree_commit

WORKER = r"""
import json, statistics, sys, time, torch
torch.set_num_threads(int(sys.argv[3]))
from verispec.backends.fast import FastRunner
from verispec.models import load_model
target = load_model(sys.argv[1], dtype=sys.argv[2])
ids = target.encode(prompt="The history of the printing press begins in the fifteenth century, when")
C = int(sys.argv[5])
ctx = (ids * C)[:C]
r = FastRunner(target.model, exact=True, weights=sys.argv[4], weight_source=target.weight_source, native=True)
r.forward(ctx, last_only=True)
for _ in range(10):
    r.forward(ctx[:1]); r.rollback(C)
print(json.dumps({"ready": True, "weight_bytes": r.net.streamed_bytes()}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    n, ts = req["positions"], []
    for _ in range(req["repeat"]):
        t0 = time.perf_counter()
        r.forward(ctx[:n])
        r.rollback(C)
        ts.append(time.perf_counter() - t0)
    print(json.dumps({"seconds": statistics.median(ts)}), flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="source tree of the code before (a git worktree)")
    ap.add_argument("--after", default=".", help="source tree of the code after")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--weights", default="q4", help="the fast path's weights format (bf16, q8, q4)")
    ap.add_argument("--positions", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--context", type=int, default=200, help="cached tokens before the timed positions")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=30, help="forwards per tree, position count and round (median)")
    ap.add_argument("--workers", type=int, default=3,
                    help="processes per tree: a process's speed depends on where its weights landed in memory "
                         "(one tree against itself in one process each: up to 7%% apart), so each tree's time "
                         "is the mean of several")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    trees = {"before": args.before, "after": args.after}
    workers, ready = {name: [] for name in trees}, {}
    for i in range(args.workers):  # launched alternately, so neither tree always starts last
        for name, tree in (trees.items() if i % 2 == 0 else reversed(trees.items())):
            if imported_from(tree) != Path(tree).resolve() / "verispec":
                raise SystemExit(f"a worker for {tree} imports verispec from {imported_from(tree)}")
            w = launch(tree, WORKER, [args.model, args.dtype, str(args.threads), args.weights, str(args.context)], args.threads,
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            line = w.stdout.readline()
            if not line:
                raise SystemExit(f"a {name} worker exited early (rc {w.wait()}); run it by hand to see why")
            ready[name] = json.loads(line)
            workers[name].append(w)
    times = {(name, n): [] for name in trees for n in args.positions}  # per round: the mean of the tree's workers
    for i in range(args.rounds):
        for name in (("before", "after") if i % 2 == 0 else ("after", "before")):  # each tree first in half the rounds
            for n in args.positions:
                got = []
                for w in workers[name]:
                    w.stdin.write(json.dumps({"positions": n, "repeat": args.repeat}) + "\n")
                    w.stdin.flush()
                    got.append(json.loads(w.stdout.readline())["seconds"])
                times[(name, n)].append(statistics.fmean(got))
    for w in (w for ws in workers.values() for w in ws):
        w.stdin.close()
        w.wait()
    rows = []
    for n in args.positions:
        ratios = [a / b for a, b in zip(times[("after", n)], times[("before", n)])]
        row = {"positions": n, "ms_before": round(statistics.median(times[("before", n)]) * 1e3, 3),
               "ms_after": round(statistics.median(times[("after", n)]) * 1e3, 3),
               "after_over_before": round(statistics.median(ratios), 4),
               "ratio_quartiles": [round(q, 4) for q in statistics.quantiles(ratios, n=4)] if len(ratios) > 1 else None}
        rows.append(row)
        print(f"{n:3d} positions  before {row['ms_before']:8.3f} ms  after {row['ms_after']:8.3f} ms  "
              f"after/before {row['after_over_before']:.4f} (median of {args.rounds} rounds)")
    if args.json:
        from verispec.bench.environment import environment

        out = {"command": "python -m dev.forward_ab " + " ".join(sys.argv[1:]), "environment": environment(),
               "trees": {k: {"path": v, "commit": tree_commit(v)} for k, v in trees.items()},
               "weight_bytes": {k: r["weight_bytes"] for k, r in ready.items()}, "context": args.context, "model": args.model,
               "dtype": args.dtype, "weights": args.weights, "threads": args.threads, "workers": args.workers, "rounds": args.rounds,
               "repeat": args.repeat, "rows": rows}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
