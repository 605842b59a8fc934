"""What the auto tree budget sees and chooses (engine.py, tree/budget.py): per method, the verification cost
curve it measured, the steps' measured costs beyond their forward (StepCosts, per budget; 0 = a plain step),
the acceptance-by-rank profile it learned and how often it chose each budget, after a few chat prompts.

    python benchmarks/budget_prices.py --methods eagle dflash --prompts 3 --tokens 128 --threads 1 \
        --json results/zen3/bench/budget_prices_avx2_zen3.json

The chat prompts are the first turns of MT-Bench questions (every 10th), so it runs on prompts that no
head trained on.
"""

from __future__ import annotations

import collections
import json

from _common import options, parse, write_json


def main() -> None:
    ap = options(__doc__, model="smollm2-135m", dtype="bfloat16", threads=None, json=False)
    ap.add_argument("--methods", nargs="+", default=["eagle", "dflash"])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    a = parse(ap)
    from verispec.api import build_engine
    from verispec.bench.environment import environment
    from verispec.bench.prompts import load_prompts
    from verispec.models import load_model
    from verispec.types import SamplingParams

    target = load_model(a.model, dtype=a.dtype)
    questions = [p for i, p in enumerate(load_prompts("mt_bench")) if i % 10 == 0][: a.prompts]
    out = {"methods": {}, "environment": environment(target)}
    for method in a.methods:
        engine = build_engine(target, method, tree="dynamic")
        chosen: collections.Counter = collections.Counter()
        shape = engine.tree_shape

        def counted(*args, **kw):
            s = shape(*args, **kw)
            chosen[0 if s is None else s.budget] += 1
            return s

        engine.tree_shape = counted
        tokens = steps = 0
        for q in questions:
            g = engine.generate(target.encode(chat=q.turns[0]), SamplingParams(max_new_tokens=a.tokens))
            tokens, steps = tokens + len(g.token_ids), steps + g.stats.steps
        ms = {str(n): round(s * 1e3, 3) for n, s in engine.verify_cost.items()}
        fig = {"curve_ms": ms, "beyond_forward_ms": {str(b): round(s * 1e3, 3) for b, s in sorted(engine.step_costs.means.items())},
               "chosen": {str(b): n for b, n in sorted(chosen.items())},
               "rank_acceptance": [round(x, 3) for x in engine.rank_acceptance.profile()],
               "tokens_per_step": round(tokens / steps, 3)}
        out["methods"][method] = fig
        print(method, json.dumps(fig))
    if a.json:
        write_json(out, a.json)


if __name__ == "__main__":
    main()
