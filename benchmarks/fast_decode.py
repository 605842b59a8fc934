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

    .venv/bin/python -m benchmarks.fast_decode --model smollm2-135m --tokens 64
    .venv/bin/python -m benchmarks.fast_decode --dtypes bfloat16 --no-compile --threads 1

--weights bf16 q8 q4 measures the weights formats of fast/quant.py side by side instead of the engine
variants: for each, plain decoding (exact mode) and n-gram speculation tok/s, and one forward over each
of --positions new positions against the floor of that format's weight bytes (what one forward reads,
FastDecoder.streamed_bytes, over the copy bandwidth). llama.cpp's eval of the same GGUF is timed beside
when llama-cpp-python is importable, else reported "not run".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from verispec.bench.report import command_line
import statistics
import time

import torch

PROMPT = "The history of the printing press begins in the fifteenth century, when"


def _cpu() -> str:
    """The CPU's model name and its bf16 / AMX / VNNI flags (figures depend on them)."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return "unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    keep = [f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")]
    return f"{name} ({' '.join(keep)})"


def _timed(fn, repeat: int = 1) -> float:
    best = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best.append(time.perf_counter() - t)
    return statistics.median(best)


def copy_bandwidth() -> float:
    """Bytes per second of a large tensor copy (read + write counted), as the roofline measures it."""
    from verispec.bench.roofline import copy_bandwidth as measure

    return measure(torch.device("cpu"))["gb_per_s"] * 1e9


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
            os.environ.pop("VERISPEC_PACKED", None)
        else:
            os.environ["VERISPEC_PACKED"] = before


def forward_cost(runner, context: list[int], n: int, repeat: int, mode=None) -> float:
    """Median seconds of one forward over n new positions after `context`, rolled back each time;
    mode: the fast runner's PassMode (None: the last generation's)."""
    runner.reset(mode=mode) if mode is not None else runner.reset()
    runner.forward(context, last_only=True)
    base = runner.length
    ids = context[:n]

    def one():
        runner.forward(ids)
        runner.rollback(base)

    one()  # warm (and compile) the shape
    return _timed(one, repeat)


def llamacpp(target, threads: int):
    """llama.cpp (llama-cpp-python, an optional extra: pip install -e .[llamacpp]) on the same GGUF, or why not."""
    from verispec.bench.baselines import llamacpp_available, load_llamacpp

    if not llamacpp_available():
        return "not run (llama-cpp-python is not installed: pip install -e .[llamacpp])"
    if target.gguf_path is None:
        return "not run (the model has no GGUF file)"
    return load_llamacpp(target.gguf_path, 1024, threads)


def llamacpp_round(llm, ids: list[int], ctx: list[int], args) -> dict:
    """One round for llama.cpp, as for ours: greedy plain decoding of --tokens new tokens after `ids` (tok/s
    over the whole generation, its prefill included) and one eval of n new positions after `ctx`."""
    out = {}
    for n in args.positions:
        times = []
        for _ in range(args.repeat):
            llm.reset()
            llm.eval(ctx)
            t = time.perf_counter()
            llm.eval(ctx[:n])
            times.append(time.perf_counter() - t)
        out[n] = statistics.median(times)
    llm.reset()  # else generate() reuses the cached ctx, which starts with ids, and skips the prefill ours runs
    t = time.perf_counter()
    got = []
    for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        got.append(tok)
        # stop where our engine stops (its EOS, or --tokens): tok/s includes the prefill, so the two must
        # spread it over the same number of tokens
        if len(got) >= args.tokens or tok == llm.token_eos():
            break
    out["tok_s"] = len(got) / (time.perf_counter() - t)
    out["new_tokens"] = len(got)
    return out


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
    ap.add_argument("--weights", nargs="+", default=None, choices=["bf16", "q8", "q4"],
                    help="compare these weights formats (bfloat16 exact plain decoding and n-gram) instead of the engine variants")
    ap.add_argument("--positions", nargs="+", type=int, default=[1, 16], help="new positions of the timed single forwards")
    ap.add_argument("--python-step", action="store_true",
                    help="with --weights: also each format on the Python layer step without the dense copy (fast/native.py off)")
    ap.add_argument("--chat", default=None, help="a chat message to decode (chat template) instead of the raw prompt")
    args = ap.parse_args()

    from verispec.api import build_engine
    from verispec.models import load_model
    from verispec.backends.fast import FastRunner, PassMode
    from verispec.backends.transformers import HFRunner
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
        ids = target.encode(chat=args.chat) if args.chat else target.encode(prompt=PROMPT)
        params = SamplingParams(max_new_tokens=args.tokens)
        ctx = (ids * 200)[:200]
        print(f"\n== {args.model} {dtype}: {weight_bytes / 1e6:.0f} MB of weights, floor {floor:.1f} tok/s")

        def report(name, tok_s, fwd=None, note="", extra=None):
            fwd = fwd or {}
            row = {"dtype": dtype, "config": name, "tok_s": tok_s, "fwd1_ms": fwd.get(1), "fwd16_ms": fwd.get(16),
                   "fwd_ms": fwd, "note": note, **(extra or {})}
            rows.append(row)
            cost = " | " + ", ".join(f"{n} pos {ms:6.1f} ms" for n, ms in fwd.items()) if fwd else ""
            if 1 in fwd and 16 in fwd:
                cost += f" ({fwd[16] / fwd[1]:.2f}x)"
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
        if args.weights:  # the weights formats side by side (fast/quant.py), exact plain decoding and n-gram
            configs = [c for w in args.weights for c in ((f"plain, exact, weights {w}", "fast", {"exact": True, "weights": w}),
                                                        (f"ngram, exact, weights {w}", "fast", {"exact": True, "weights": w,
                                                                                               "method": "ngram"}))]
            if args.python_step:  # the same with the Python layer step and no dense copy (before native.py)
                configs += [(f"{name}, python step", backend, {**opts, "native": False})
                            for name, backend, opts in configs]
        elif not args.no_compile:
            configs += [("engine fast, compiled, exact", "fast", {"exact": True, "compile": True}),
                        ("engine fast, compiled, not exact", "fast", {"exact": False, "compile": True})]
        engines, warm = {}, {}
        for name, backend, opts in configs:
            with packing(opts.get("packed", True)):
                target.weights = opts.get("weights", "bf16")
                runner = None
                if backend == "fast":  # natural_rows False: every layer runs exact_bucket rows
                    mode = PassMode.of(opts["exact"], opts.get("compile", False), opts.get("natural_rows", True))
                    runner = FastRunner(target.model, capacity=target.context_length + 256, exact=mode,
                                        exact_bucket=args.exact_bucket, compile=opts.get("compile", False),
                                        weights=target.weights, weight_source=getattr(target, "weight_source", None))
                engine = build_engine(target, opts.get("method", "ar"), backend=backend, runner=runner,
                                      **{k: v for k, v in opts.items() if k not in ("natural_rows", "packed", "weights", "method", "native")})
            if isinstance(engine.runner, FastRunner):
                engine.runner.native = engine.runner.wide = opts.get("native", True)
            t0 = time.perf_counter()
            engine.generate(ids, SamplingParams(max_new_tokens=4))  # warm: compiles the buckets it meets
            warm[name] = time.perf_counter() - t0
            engines[name] = engine
        # every configuration once per round, rounds interleaved: the machine's speed drifts by tens of
        # percent over minutes, so each figure is the median over rounds measured side by side
        llm = llamacpp(target, torch.get_num_threads()) if args.weights else None
        seen: dict[str, list[tuple]] = {name: [] for name in ["transformers generate()", *engines]}
        cpp_rounds: list[dict] = []
        bws: list[float] = []  # copy bandwidth at each round's start: floors pair with the load of their round
        outputs: dict[str, list[int]] = {}
        for _ in range(args.rounds):
            bws.append(copy_bandwidth())
            seen["transformers generate()"].append((hf_generate(), {}))
            if llm is not None and not isinstance(llm, str):
                cpp_rounds.append(llamacpp_round(llm, ids, ctx, args))
            for name, backend, opts in configs:
                engine = engines[name]
                gen = engine.generate(ids, params)
                runner = engine.runner
                fwd = {n: forward_cost(runner, ctx, n, args.repeat) for n in args.positions} if "ngram" not in name else {}
                if args.weights and fwd:  # and outside exact mode (fused attention, one native call per pass)
                    loose = PassMode.of(False, opts.get("compile", False))
                    fwd.update({-n: forward_cost(runner, ctx, n, args.repeat, loose) for n in args.positions})
                    runner.reset(mode=PassMode.of(True, opts.get("compile", False)))
                seen[name].append((gen.stats.new_tokens / gen.stats.total_time, fwd, gen.stats.new_tokens))
                outputs[name] = gen.token_ids
        for name, got in seen.items():
            tok_s = statistics.median(g[0] for g in got)
            fwd = {n: statistics.median(g[1][n] for g in got) * 1e3 for n in (got[0][1] or {})}
            loose = {-n: fwd.pop(n) for n in [n for n in fwd if n < 0]}  # not exact: keyed -n while measured
            compiled = name in warm and "compiled" in name
            extra = {"new_tokens": got[-1][2]} if len(got[0]) > 2 else {}
            if name in engines and isinstance(engines[name].runner, FastRunner):
                net = engines[name].runner.net
                nbytes = net.streamed_bytes()
                rbw = statistics.median(bws)
                extra.update({"weights": net.weights, "weight_bytes": nbytes, "floor_ms": nbytes / rbw * 1e3})
                n1 = min(args.positions)

                def over_floor(key):  # per round against that round's bandwidth, then the median
                    return statistics.median(g[1][key] / (nbytes / b) for g, b in zip(got, bws))
                if fwd:
                    extra["fwd1_over_floor"] = over_floor(n1)
                if loose:
                    extra["fwd_ms_not_exact"] = loose
                    extra["fwd1_not_exact_over_floor"] = over_floor(-n1)
                if name.startswith("ngram"):  # speculation must give plain decoding's tokens with the same weights
                    extra["equals_plain"] = outputs[name] == outputs[name.replace("ngram", "plain", 1)]
            report(name, tok_s, fwd, note=f"(first call {warm[name]:.1f} s)" if compiled else "", extra=extra)
            if extra and fwd:
                print(f"{'':34s} {net.weights}: {nbytes / 1e6:.0f} MB read per forward, floor {extra['floor_ms']:.1f} ms, "
                      f"{min(fwd)} pos = {extra['fwd1_over_floor']:.2f}x the floor")
                if loose:
                    print(f"{'':34s} not exact: " + ", ".join(f"{n} pos {ms:6.1f} ms" for n, ms in loose.items())
                          + f" ({extra['fwd1_not_exact_over_floor']:.2f}x the floor)")
        if args.weights and cpp_rounds:
            gguf = os.path.getsize(target.gguf_path)  # what its forward reads: about the whole file (tied head)
            fwd = {n: statistics.median(r[n] for r in cpp_rounds) * 1e3 for n in args.positions}
            n1 = min(args.positions)
            extra = {"weights": "the GGUF's own", "weight_bytes": gguf, "floor_ms": gguf / statistics.median(bws) * 1e3,
                     "fwd1_over_floor": statistics.median(r[n1] / (gguf / b) for r, b in zip(cpp_rounds, bws)),
                     "status": "run", "new_tokens": cpp_rounds[-1]["new_tokens"]}
            report("llama.cpp plain (same GGUF)", statistics.median(r["tok_s"] for r in cpp_rounds), fwd, extra=extra)
        elif args.weights:
            rows.append({"dtype": dtype, "config": "llama.cpp plain (same GGUF)", "status": llm})
            print(f"{'llama.cpp plain (same GGUF)':34s} {llm}")
        del target, model
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"copy_bandwidth": bw, "copy_bandwidth_rounds": bws, "rows": rows, "command": command_line(),
                       "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": _cpu()}, fh, indent=1)


if __name__ == "__main__":
    main()
