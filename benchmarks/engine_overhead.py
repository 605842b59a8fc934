"""What plain decoding spends outside the target's forward, per token: the engine's step (planning,
acceptance, the output's rules) and the text tracker's detokenization, with the tracker's windowed
decoding (output._TextTracker) and with decoding every id at every step, alternated in one process.

    python benchmarks/engine_overhead.py --tokens 1024 --rounds 4 --threads 1 \
        --json results/zen3/kernels/engine_overhead_detok_avx2_zen3.json
"""

from __future__ import annotations

import statistics
import time

from _common import options, parse, write_json


def main() -> None:
    ap = options(__doc__, model="smollm2-135m", dtype="bfloat16", threads=1, json=None)
    ap.add_argument("--tokens", type=int, default=1024, help="new tokens per generation (greedy, to the cap unless EOS)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompt", default="Write a long essay about the history of Rome.")
    a = parse(ap)
    from verispec import output
    from verispec.api import _params, build_engine
    from verispec.models import load_model

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
    ways = {"windowed": output._TextTracker._decode, "whole": lambda self, ids: self.decode(ids)}
    seen = {k: [] for k in ways}
    texts, n = {}, 0
    params = _params(max_new_tokens=a.tokens)
    try:
        for r in range(a.rounds):
            for name in (list(ways) if r % 2 else list(reversed(ways))):
                output._TextTracker._decode = ways[name]
                spent["forward"] = 0.0
                t0 = time.perf_counter()
                g = engine.generate(ids, params)
                took = time.perf_counter() - t0
                n, texts[name] = len(g.token_ids), g.text
                seen[name].append((took - spent["forward"]) * 1e3 / n)
    finally:
        output._TextTracker._decode = ways["windowed"]
    ms = {k: statistics.median(v) for k, v in seen.items()}
    same = texts["windowed"] == texts["whole"]
    print(f"{n} tokens; the same text: {same}")
    for k, v in seen.items():
        print(f"{k:9s} outside the forward: {ms[k]:.3f} ms a token (rounds: {', '.join(f'{x:.3f}' for x in v)})")
    if a.json:
        from verispec.bench.environment import environment

        write_json({"environment": environment(), "tokens": n, "same_text": same, "ms_per_token_outside_forward": ms,
                    "rounds": seen}, a.json)


if __name__ == "__main__":
    main()
