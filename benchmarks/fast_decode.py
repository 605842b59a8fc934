"""Side-by-side decoding speed of the fast path (verispec.fast) against transformers, in one run.

For each dtype it measures, on the same prompt and the same number of new tokens (greedy):
  * transformers `model.generate()`                       (the baseline of the issue)
  * our engine, plain decoding, on the hf backend          (HFRunner: transformers forward + DynamicCache)
  * our engine, plain decoding, on the fast backend: eager, exact mode on (natural rows, and every layer
    at 8 rows as before row_invariance.py) and off, and torch.compile'd
and the cost of ONE forward over 1 and over 16 new positions after a 200-token context (the verification
premise: 16 positions should cost little more than 1), plus the bandwidth floor (weight bytes / measured
copy bandwidth). tok/s counts new tokens over the whole generation (prefill of a short prompt included). Every figure
is the median of --rounds rounds that each measure every configuration once, side by side.

    .venv/bin/python benchmarks/fast_decode.py --model smollm2-135m --tokens 64
    .venv/bin/python benchmarks/fast_decode.py --dtypes bfloat16 --no-compile --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch

PROMPT = "The history of the printing press begins in the fifteenth century, when"


def _timed(fn, repeat: int = 1) -> float:
    best = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best.append(time.perf_counter() - t)
    return statistics.median(best)


def copy_bandwidth() -> float:
    """Bytes per second of a large tensor copy (read + write counted), median of a few."""
    src = torch.empty(64 * 2**20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = _timed(lambda: dst.copy_(src), repeat=5)
    return 2 * src.numel() / t


@contextlib.contextmanager
def packing(on: bool):
    """Packing turned off (VERISPEC_PACKED=0) for the runners built inside when `on` is False (fast/packed.py
    reads it when a runner is built); when True, the environment is left as the user set it."""
    before = os.environ.get("VERISPEC_PACKED")
    if not on:
        os.environ["VERISPEC_PACKED"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["VERISPEC_PACKED"]
        else:
            os.environ["VERISPEC_PACKED"] = before


def forward_cost(runner, context: list[int], n: int, repeat: int) -> float:
    """Median seconds of one forward over n new positions after `context`, rolled back each time."""
    runner.reset()
    runner.forward(context, last_only=True)
    base = runner.length
    ids = context[:n]

    def one():
        runner.forward(ids)
        runner.crop(base)

    one()  # warm (and compile) the shape
    return _timed(one, repeat)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per generation")
    ap.add_argument("--repeat", type=int, default=5, help="repeats of each single-forward timing")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all configurations; figures are medians")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave the default)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows (compiling takes minutes)")
    ap.add_argument("--exact-bucket", type=int, default=8)
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = ap.parse_args()

    from verispec.api import build_engine
    from verispec.models import load_model
    from verispec.runner import HFRunner
    from verispec.fast import FastRunner
    from verispec.types import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    bw = copy_bandwidth()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, copy bandwidth {bw / 1e9:.1f} GB/s")
    rows = []
    for dtype in args.dtypes:
        target = load_model(args.model, dtype=dtype)
        model = target.model
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        floor = bw / weight_bytes  # forwards per second if only the weights were read
        ids = target.encode(prompt=PROMPT)
        params = SamplingParams(max_new_tokens=args.tokens)
        ctx = (ids * 200)[:200]
        print(f"\n== {args.model} {dtype}: {weight_bytes / 1e6:.0f} MB of weights, floor {floor:.1f} tok/s")

        def report(name, tok_s, f1=None, f16=None, note=""):
            row = {"dtype": dtype, "config": name, "tok_s": tok_s, "fwd1_ms": f1, "fwd16_ms": f16, "note": note}
            rows.append(row)
            cost = f" | 1 pos {f1 * 1e3:6.1f} ms, 16 pos {f16 * 1e3:6.1f} ms ({f16 / f1:.2f}x)" if f1 else ""
            print(f"{name:34s} {tok_s:6.1f} tok/s ({tok_s / floor:4.0%} of floor){cost} {note}", flush=True)

        x = torch.tensor([ids])
        gen_kwargs = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
        with torch.inference_mode():
            model.generate(x, max_new_tokens=2, do_sample=False)  # warm

        def hf_generate() -> float:
            with torch.inference_mode():
                t = _timed(lambda: model.generate(x, **gen_kwargs))
            return args.tokens / t

        configs = [("engine hf backend", "hf", {}),
                   ("engine fast, eager, exact", "fast", {"exact": True}),
                   ("engine fast, eager, exact, 8-row", "fast", {"exact": True, "natural_rows": False}),
                   ("engine fast, eager, not exact", "fast", {"exact": False}),
                   # F.linear on plain weights (VERISPEC_PACKED=0): what packing (widened for bf16 on CPUs
                   # without bf16 instructions, fast/packed.py) buys
                   ("engine fast, eager, not exact, unpacked", "fast", {"exact": False, "packed": False})]
        if not args.no_compile:
            configs += [("engine fast, compiled, exact", "fast", {"exact": True, "compile": True}),
                        ("engine fast, compiled, not exact", "fast", {"exact": False, "compile": True})]
        engines, warm = {}, {}
        for name, backend, opts in configs:
            with packing(opts.get("packed", True)):
                engine = build_engine(target, "ar", backend=backend,
                                      **{k: v for k, v in opts.items() if k not in ("natural_rows", "packed")})
            if isinstance(engine.runner, FastRunner):
                engine.runner.exact_bucket = args.exact_bucket
                engine.runner.natural_rows = opts.get("natural_rows", True)  # False: every layer runs 8 rows
            t0 = time.perf_counter()
            engine.generate(ids, SamplingParams(max_new_tokens=4))  # warm: compiles the buckets it meets
            warm[name] = time.perf_counter() - t0
            engines[name] = engine
        # every configuration once per round, rounds interleaved: the machine's speed drifts by tens of
        # percent over minutes, so each figure is the median over rounds measured side by side
        seen: dict[str, list[tuple]] = {name: [] for name in ["transformers generate()", *engines]}
        for _ in range(args.rounds):
            seen["transformers generate()"].append((hf_generate(), None, None))
            for name, backend, opts in configs:
                engine = engines[name]
                gen = engine.generate(ids, params)
                runner = engine.runner
                if isinstance(runner, FastRunner):
                    runner.exact = bool(opts.get("exact"))
                seen[name].append((gen.stats.new_tokens / gen.stats.total_time,
                                   forward_cost(runner, ctx, 1, args.repeat), forward_cost(runner, ctx, 16, args.repeat)))
        for name, got in seen.items():
            tok_s, f1, f16 = (statistics.median(v) if v[0] is not None else None for v in zip(*got))
            compiled = name in warm and "compiled" in name
            report(name, tok_s, f1, f16, note=f"(first call {warm[name]:.1f} s)" if compiled else "")
        del target, model
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"copy_bandwidth": bw, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
