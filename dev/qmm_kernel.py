"""qmm.py's kernel against its source at another git revision, in one process: that revision's C++ is built
under a renamed operator, both are checked bit for bit on a sweep (4- and 8-bit weights, 1-21 rows,
float32 and bfloat16 activations), then timed interleaved at the target's projection shapes for a range of
rows (us per call, median of rounds). A shape timed call after call stays in the caches; `--stream` also
times one pass over a whole forward's weights (SmolLM2-135M's 30 layers of 4-bit projections and its 8-bit
LM head, ~95 MB, so every weight comes from memory as in a real forward), rounds alternating the order.

    python -m dev.qmm_kernel --against d4883a3 --threads 1 --json results/zen3/kernels/qmm_kernel_16ch_avx2_zen3.json
    python -m dev.qmm_kernel --against e0ef810 --threads 1 --shapes --stream --rows 1 2 4 8
"""

from __future__ import annotations

import statistics
import time

import torch
from verispec.bench.script import options, parse, write_json

from dev.revision import op_at_revision


def _weights(n: int, k: int, bits: int, g: torch.Generator):
    from verispec.fast import qmm

    if bits == 4:
        return qmm.pack4(torch.randint(0, 16, (n, k), generator=g), torch.rand(n, k // 32, generator=g) * 0.01,
                         torch.rand(n, k // 32, generator=g) * 0.01 - 0.005)
    return qmm.pack8(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, generator=g) * 0.01)


def _sweep(new, old) -> int:
    g = torch.Generator().manual_seed(0)
    cases = 0
    for bits in (4, 8):
        for n, k in ((16, 32), (48, 96), (160, 576), (64, 1536)):
            w = _weights(n, k, bits, g)
            for m in range(1, 22):
                for dtype in (torch.float32, torch.bfloat16):
                    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
                    a, b = new(x, w.w, w.sc), old(x, w.w, w.sc)
                    if not torch.equal(a.float().view(torch.int32), b.float().view(torch.int32)):
                        raise SystemExit(f"bits differ: bits={bits} n={n} k={k} rows={m} {dtype}")
                    cases += 1
    return cases


def main() -> None:
    ap = options(__doc__, threads=1, json=None)
    ap.add_argument("--against", required=True, help="a git revision whose qmm kernel (verispec/csrc/qmm.cpp) to compare with")
    ap.add_argument("--shapes", nargs="*", default=["4:1536x576", "4:576x1536", "8:49152x576"],
                    help="bits:NxK (default: SmolLM2-135M's gate/up and down projections and its 8-bit LM head)")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 3, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--stream", action="store_true", help="also time a forward's whole weight stream per row count")
    args = parse(ap)
    from verispec.fast import ops, qmm

    if qmm.available() is not None:
        raise SystemExit(f"the qmm kernel does not run here: {qmm.available()}")
    new = torch.ops.verispec.qmm
    old = op_at_revision(args.against, "qmm.cpp", "qmm", ops.Flags(("-O3",)))
    cases = _sweep(new, old)
    print(f"bit-equal to {args.against} on {cases} cases")
    g = torch.Generator().manual_seed(1)
    rows = []
    for shape in args.shapes:
        bits, nk = shape.split(":")
        n, k = (int(v) for v in nk.split("x"))
        w = _weights(n, k, int(bits), g)
        for m in args.rows:
            x = torch.randn(m, k, generator=g).bfloat16()
            calls = max(3, int(2e8 / (n * k * max(m, 4))))
            seen = {"before": [], "after": []}
            for _ in range(args.rounds):
                for name, f in (("before", old), ("after", new)):
                    t = time.perf_counter()
                    for _ in range(calls):
                        f(x, w.w, w.sc)
                    seen[name].append((time.perf_counter() - t) / calls * 1e6)
            us = {key: statistics.median(v) for key, v in seen.items()}
            rows.append({"bits": int(bits), "n": n, "k": k, "rows": m, "us_before": us["before"], "us_after": us["after"],
                         "after_over_before": us["after"] / us["before"]})
            print(f"{bits}-bit {n:6d} x {k:5d}, {m:2d} rows: {us['before']:8.1f} -> {us['after']:8.1f} us "
                  f"({us['after'] / us['before']:.3f}x)")
    stream = _stream(old, new, args.rows, args.rounds, g) if args.stream else []
    if args.json:
        from verispec.bench.environment import environment

        write_json({"environment": environment(), "against": args.against, "bit_equal_cases": cases, "rows": rows,
                    "stream": stream}, args.json)


def _stream(old, new, row_counts: list[int], rounds: int, g: torch.Generator) -> list[dict]:
    """ms per pass over SmolLM2-135M's weights (per layer q/k/v, o, gate/up, down; then the LM head)."""
    layer = [(4, 960, 576), (4, 576, 576), (4, 3072, 576), (4, 576, 1536)]
    seq = [_weights(n, k, bits, g) for _ in range(30) for bits, n, k in layer] + [_weights(49152, 576, 8, g)]
    out = []
    for m in row_counts:
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in (576, 1536)}
        seen = {"before": [], "after": []}
        for r in range(2 * rounds):
            for name, f in (("before", old), ("after", new)) if r % 2 else (("after", new), ("before", old)):
                t = time.perf_counter()
                for w in seq:
                    f(xs[w.w.shape[1] * 32], w.w, w.sc)
                seen[name].append((time.perf_counter() - t) * 1e3)
        ms = {key: statistics.median(v) for key, v in seen.items()}
        out.append({"rows": m, "ms_before": ms["before"], "ms_after": ms["after"], "after_over_before": ms["after"] / ms["before"]})
        print(f"a forward's weights, {m:2d} rows: {ms['before']:7.2f} -> {ms['after']:7.2f} ms ({ms['after'] / ms['before']:.3f}x)")
    return out


if __name__ == "__main__":
    main()
