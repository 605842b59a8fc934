"""Held-out figures of a trained head as it ships (train/evaluate.py): per task, chain and tree mean
accepted length, top-1 agreement by draft step, output equal to plain decoding.

Tasks: the Spec-Bench public questions (--bench per task, the bench's seeded choice) and, with --work,
the held-out records of that training work folder (data.split_heldout; only meaningful for a head that
was trained in that folder, since another head may have trained on them).

    .venv/bin/python -m benchmarks.head_heldout --kind eagle --bench 4 --json results/xeon/heads/eagle-heldout-shipped.json
"""

from __future__ import annotations

import json
from pathlib import Path

from verispec.bench.script import options, parse, write_json


def main() -> None:
    ap = options(__doc__, dtype="bfloat16", threads=None, json=True)
    ap.add_argument("--kind", default="eagle", choices=["eagle", "medusa", "dflash"])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--head", default=None, help="a head folder (default: the shipped head)")
    ap.add_argument("--bench", type=int, default=4, help="Spec-Bench questions per task")
    ap.add_argument("--work", default=None, help="a training work folder whose held-out records to add")
    ap.add_argument("--per-source", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--weights", default="auto", help="the target's weights: auto, bf16, q8 or q4")
    a = parse(ap)
    from verispec.drafters.dflash import load_dflash_model
    from verispec.drafters.eagle import load_eagle_head
    from verispec.drafters.medusa import load_medusa_heads
    from verispec.bench.environment import environment
    from verispec.models import load_model
    from verispec.train.data import read_jsonl, split_heldout
    from verispec.train.evaluate import eval_sets, evaluate_head

    target = load_model(a.target, dtype=a.dtype, weights=a.weights)
    load = {"eagle": load_eagle_head, "medusa": load_medusa_heads, "dflash": load_dflash_model}[a.kind]
    module = load(target, a.head)
    heldout = split_heldout(read_jsonl(Path(a.work) / "answers.jsonl"))[1] if a.work else None
    sets = eval_sets(target, heldout, a.per_source, a.bench)
    # the DFlash drafter's chain is its whole block, drafted in one forward (as verispec train evaluates it)
    chain = {"draft_length": module.config["block_size"] - 1} if a.kind == "dflash" else {}
    fig = evaluate_head(target, a.kind, module, sets, max_new_tokens=a.tokens, **chain)
    out = {"head": a.head or "shipped", "weights": a.weights, "trained_on": module.config.get("training", {}).get("sequences"), **fig,
           "environment": environment(target)}
    write_json(out, a.json)
    print(json.dumps(fig["overall"]))


if __name__ == "__main__":
    main()
