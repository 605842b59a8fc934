"""Gemma 3 270M with the SmolLM2-135M draft (another tokenizer), side by side with plain decoding.

One run, one question per Spec-Bench task (chat prompts), greedy, the fast path (exact mode):
  * plain decoding of the target, and of the draft alone on the same text: the per-token cost of each,
    whose ratio c (draft / target) bounds what any draft model can give (theory.speedup);
  * method draft with the SmolLM2 draft at each --k: acceptance rate (target tokens accepted / drafted),
    mean accepted length tau, wall-clock speedup over plain decoding, and whether every output equals
    plain decoding's token for token.
Contenders run one after the other per question (the machine is shared; the ratios are what count).

    .venv/bin/python benchmarks/cross_vocab.py --dtype bfloat16 --threads 1 --json results/cpu/cross_vocab.json
"""

from __future__ import annotations

import json
import sys

from _common import options, parse, write_json


def main() -> None:
    ap = options(__doc__, model="gemma3-270m", dtype="bfloat16", threads=None, json=None)
    ap.add_argument("--draft", default="smollm2-135m")
    ap.add_argument("--k", type=int, nargs="+", default=[3, 5])
    ap.add_argument("--per-task", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    a = parse(ap)
    from verispec.api import build_engine
    from verispec.bench import prompts as pr
    from verispec.bench.environment import environment
    from verispec.models import load_model
    from verispec.theory import speedup
    from verispec.types import SamplingParams

    target = load_model(a.model, dtype=a.dtype)
    draft = load_model(a.draft, dtype=a.dtype)
    questions = pr.sample(pr.group_tasks(pr.load_prompts("spec_bench")), a.per_task, seed=0)
    params = SamplingParams(max_new_tokens=a.max_new_tokens)
    engines = {"ar": build_engine(target, "ar", backend="fast"),
               "draft_alone": build_engine(draft, "ar", backend="fast")}
    for k in a.k:
        engines[f"draft_k{k}"] = build_engine(target, "draft", draft=draft, draft_length=k, backend="fast")
    warm = target.encode(chat="Say hello.")
    for name, e in engines.items():  # untimed warm-up
        e.generate(draft.encode(chat="Say hello.") if name == "draft_alone" else warm, SamplingParams(max_new_tokens=8))
    sums = {n: {"time": 0.0, "tokens": 0, "drafted": 0, "accepted": 0, "steps": 0, "draft_time": 0.0} for n in engines}
    rows, all_equal = [], True
    for q in questions:
        ids = target.encode(chat=q.turns[0])
        plain = None
        for name, e in engines.items():
            g = e.generate(draft.encode(chat=q.turns[0]) if name == "draft_alone" else ids, params)
            s = sums[name]
            s["time"] += g.stats.total_time - g.stats.prefill_time
            s["tokens"] += g.stats.new_tokens
            s["drafted"] += g.stats.drafted
            s["accepted"] += g.stats.accepted
            s["steps"] += g.stats.steps
            s["draft_time"] += g.stats.draft_time
            if name == "ar":
                plain = g.token_ids
            elif name.startswith("draft_k"):
                same = g.token_ids == plain
                all_equal &= same
                rows.append({"question_id": q.question_id, "task": q.category, "contender": name,
                             "equal_to_plain": same, "tokens": g.stats.new_tokens, "drafted": g.stats.drafted,
                             "accepted": g.stats.accepted, "steps": g.stats.steps,
                             "decode_s": round(g.stats.total_time - g.stats.prefill_time, 4)})
        print(q.category, "done", file=sys.stderr, flush=True)
    per_token = {n: s["time"] / max(1, s["tokens"]) for n, s in sums.items()}
    c = per_token["draft_alone"] / per_token["ar"]
    out = {"environment": environment(target),
           "what": "target gemma3-270m, draft smollm2-135m (another tokenizer): string-level exact match; decode "
                   "time excludes the prefill",
           "questions": len(questions), "max_new_tokens": a.max_new_tokens,
           "per_token_ms": {n: round(1e3 * v, 2) for n, v in per_token.items()},
           "draft_target_cost_ratio": round(c, 3), "every_output_equal_to_plain": all_equal, "contenders": {}}
    for name, s in sums.items():
        if not name.startswith("draft_k"):
            continue
        k = int(name[len("draft_k"):])
        alpha = s["accepted"] / max(1, s["drafted"])
        out["contenders"][name] = {
            "draft_length": k, "acceptance_rate": round(alpha, 3),
            "mean_accepted_length": round(s["tokens"] / max(1, s["steps"]), 3),
            "speedup_vs_plain": round(sums["ar"]["time"] / s["time"], 3) if s["time"] else None,
            "draft_time_share": round(s["draft_time"] / s["time"], 3) if s["time"] else None,
            "theory_speedup_at_measured_alpha_c": round(speedup(min(alpha, 0.999), k, c), 3)}
    out["runs"] = rows
    print(json.dumps({k: v for k, v in out.items() if k not in ("runs", "environment")}, indent=1))
    if a.json:
        write_json(out, a.json)


if __name__ == "__main__":
    main()
