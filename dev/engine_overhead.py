"""What plain decoding spends outside the target's forward, per token: the engine's step (planning,
acceptance, the output's rules) and the text tracker's detokenization, with the tracker's windowed
decoding (output.TextTracker) and with decoding every id at every step (TextTracker(..., windowed=False)),
the tracker timed alone over the generation's ids, both ways alternated in one process.

    python -m dev.engine_overhead --tokens 1024 --rounds 4 --threads 1 \
        --json results/zen3/kernels/engine_overhead_detok_avx2_zen3.json
"""

from __future__ import annotations

import statistics
import time

from verispec.bench.script import options, parse, write_json


def main() -> None:
    ap = options(__doc__, model="smollm2-135m", dtype="bfloat16", threads=1, json=None)
    ap.add_argument("--tokens", type=int, default=1024, help="new tokens per generation (greedy, to the cap unless EOS)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompt", default="Write a long essay about the history of Rome.")
    a = parse(ap)
    from verispec.api import build_engine
    from verispec.models import load_model
    from verispec.output import TextTracker
    from verispec.types import SamplingParams

    target = load_model(a.model, dtype=a.dtype)
    ids = target.encode(chat=[{"role": "user", "content": a.prompt}])
    engine = build_engine(target, "ar")
    forward = engine.runner.forward
    spent = {"forward": 0.0}

    def timed(*args, **kw):
        t0 = time.perf_counter()
        out = forward(*args, **kw)
        spent["forward"] += time.perf_counter() - t0
        return out

    engine.runner.forward = timed
    params = SamplingParams(max_new_tokens=a.tokens)

    def tracker(windowed: bool) -> tuple[float, str]:
        """The text tracker alone over the generation's ids, one more id a step as plain decoding commits them."""
        t = TextTracker(target.decode, (), windowed=windowed)
        t0 = time.perf_counter()
        for i in range(1, len(out_ids) + 1):
            t.update(out_ids[:i], final=i == len(out_ids))
        return time.perf_counter() - t0, t.text

    seen = {"engine": [], "tracker_windowed": [], "tracker_whole": []}
    texts, n = {}, 0
    for r in range(a.rounds):
        spent["forward"] = 0.0
        t0 = time.perf_counter()
        g = engine.generate(ids, params)
        took = time.perf_counter() - t0
        out_ids, n, texts["engine"] = list(g.token_ids), len(g.token_ids), g.text
        seen["engine"].append((took - spent["forward"]) * 1e3 / n)
        for windowed in ((True, False) if r % 2 else (False, True)):  # alternated: drift hits both alike
            took, texts[windowed] = tracker(windowed)
            seen["tracker_windowed" if windowed else "tracker_whole"].append(took * 1e3 / n)
    med = {k: statistics.median(v) for k, v in seen.items()}
    # what a step spends outside the forward with each way of detokenizing: the engine as it runs (windowed),
    # and the same with the whole-text tracker's cost in place of the windowed one's
    ms = {"windowed": med["engine"], "whole": med["engine"] - med["tracker_windowed"] + med["tracker_whole"]}
    same = texts["engine"] == texts[True] == texts[False]
    print(f"{n} tokens; the same text: {same}")
    for k, v in seen.items():
        print(f"{k:17s} {med[k]:.3f} ms a token (rounds: {', '.join(f'{x:.3f}' for x in v)})")
    for k, v in ms.items():
        print(f"outside the forward, {k} text: {v:.3f} ms a token")
    if a.json:
        from verispec.bench.environment import environment

        write_json({"environment": environment(), "tokens": n, "same_text": same, "ms_per_token_outside_forward": ms,
                    "rounds": seen}, a.json)


if __name__ == "__main__":
    main()
