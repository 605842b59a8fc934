"""attend.py's kernel against its source at another git revision, in one process: that revision's C++ is built
under a renamed operator, both are checked bit for bit on a sweep of shapes (head dims, head groupings, rows,
lengths, orders, masked columns), then timed interleaved at decode and verification shapes (us per call).

    python -m dev.attend_kernel --against 831fae5 --threads 1 --json results/zen3/kernels/attend_kernel_full_chunks_avx2_zen3.json
"""

from __future__ import annotations

import statistics
import time

import torch
from verispec.bench.script import options, parse, write_json

from dev.revision import op_at_revision


def _sweep(new, old) -> int:
    g = torch.Generator().manual_seed(0)
    cases = 0
    for D in (64, 48, 17, 80, 128, 256, 5):
        for H, KVH in ((9, 3), (4, 4), (8, 1), (12, 2)):
            for T in (1, 3, 8):
                for L in (1, 15, 16, 17, 33, 65, 201):
                    S = L + 8
                    kv = torch.randn(2 * KVH, S, D, generator=g)
                    q = torch.randn(H, T, D, generator=g)
                    bias = torch.where(torch.rand(T, L, generator=g) < 0.2, float("-inf"), 0.0)
                    bias[:, 0] = 0
                    for order in (torch.empty(0, dtype=torch.long), torch.stack([torch.randperm(S, generator=g)[:L] for _ in range(T)])):
                        a = new(q, kv[:KVH], kv[KVH:], bias, order, 0.125)
                        b = old(q, kv[:KVH], kv[KVH:], bias, order, 0.125)
                        if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
                            raise SystemExit(f"bits differ: D={D} H={H} KVH={KVH} T={T} L={L}")
                        cases += 1
    return cases


def main() -> None:
    ap = options(__doc__, threads=1, json=None)
    ap.add_argument("--against", required=True, help="a git revision whose attend kernel (verispec/csrc/attend.cpp) to compare with")
    ap.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("H", "KVH", "D"))
    ap.add_argument("--shapes", nargs="+", default=["1:201", "8:208", "16:216", "1:1000", "8:1008"], help="rows:columns")
    ap.add_argument("--rounds", type=int, default=7)
    args = parse(ap)
    from verispec.fast import attend

    if attend.available() is not None:
        raise SystemExit(f"the attend kernel does not run here: {attend.available()}")
    from verispec.fast import ops

    new = torch.ops.verispec.attend
    old = op_at_revision(args.against, "attend.cpp", "attend", ops.for_cpu())
    cases = _sweep(new, old)
    print(f"bit-equal to {args.against} on {cases} cases")
    H, KVH, D = args.heads
    rows = []
    for shape in args.shapes:
        T, L = (int(v) for v in shape.split(":"))
        kv = torch.randn(2 * KVH, max(1024, L + 16), D)
        q, bias, none = torch.randn(H, T, D), torch.zeros(T, L), torch.empty(0, dtype=torch.long)
        seen = {"before": [], "after": []}
        for _ in range(args.rounds):
            for name, f in (("before", old), ("after", new)):
                t = time.perf_counter()
                for _ in range(100):
                    f(q, kv[:KVH], kv[KVH:], bias, none, 0.125)
                seen[name].append((time.perf_counter() - t) / 100 * 1e6)
        us = {k: statistics.median(v) for k, v in seen.items()}
        rows.append({"rows": T, "columns": L, "us_before": us["before"], "us_after": us["after"], "after_over_before": us["after"] / us["before"]})
        print(f"{T:3d} rows x {L:5d} columns: {us['before']:7.1f} -> {us['after']:7.1f} us ({us['after'] / us['before']:.3f}x)")
    if args.json:
        from verispec.bench.environment import environment

        write_json({"environment": environment(), "against": args.against, "bit_equal_cases": cases,
                    "heads": {"H": H, "KVH": KVH, "D": D}, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
