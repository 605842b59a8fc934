"""Where a trained head's drafts miss, against how sure the target itself is.

Teacher-forced on text the head never trained on (the held-out self-distilled answers of a training work
folder, and plain decoding's continuations of the Spec-Bench questions the bench uses), for every answer
position and draft step j: the target's own next-token distribution at that point (its argmax is the token
a greedy verification accepts, its top-1 probability p says how sure the target is) and the head's
draft-vocabulary logits. Reported per draft step, overall and per bin of p:
  - the share of positions in the bin,
  - top-1 agreement (the head's argmax is the target's) and top-4 (the target's token is among the head's
    four best: what a tree of width 4 can offer at that node),
  - the share of labels outside the draft vocabulary (no head with that vocabulary can draft them).
A head limited by its data or capacity misses where the target is sure; a head limited by the target's own
uncertainty misses where p is low, and the bins' shares then bound what any cheap drafter of this target
can reach for greedy decoding.

    python -m dev.head_ceiling --kind eagle --work .verispec-train/v8 --per-source 40 --bench 4 \
        --threads 1 --json results/zen4/heads/eagle-ceiling-shipped-zen4.json
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from verispec.bench.script import options, parse, write_json

BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0001)


def _bin_rows(p: torch.Tensor, top1: torch.Tensor, top4: torch.Tensor, oov: torch.Tensor) -> list[dict]:
    rows = []
    for lo, hi in zip(BINS[:-1], BINS[1:]):
        m = (p >= lo) & (p < hi)
        n = int(m.sum())
        rows.append({"p": [lo, min(hi, 1.0)], "share": round(n / max(1, p.numel()), 4),
                     "top1": round(float(top1[m].float().mean()), 4) if n else None,
                     "top4": round(float(top4[m].float().mean()), 4) if n else None,
                     "oov": round(float(oov[m].float().mean()), 4) if n else None})
    return rows


def _summary(step: int, parts: list[tuple[torch.Tensor, ...]]) -> dict:
    """Per-sequence (p, top1, top4, oov) tensors of one draft step -> its figures, overall and by bin of p."""
    p, top1, top4, oov = (torch.cat(x) for x in zip(*parts))
    return {"step": step, "positions": p.numel(), "top1": round(float(top1.float().mean()), 4),
            "top4": round(float(top4.float().mean()), 4), "oov": round(float(oov.float().mean()), 4),
            "mean_p": round(float(p.mean()), 4), "by_p": _bin_rows(p, top1, top4, oov)}


def main() -> None:
    ap = options(__doc__, dtype="bfloat16", threads=None, json=None)
    ap.add_argument("--kind", default="eagle", choices=["eagle", "medusa", "dflash"])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--head", default=None, help="a head folder (default: the shipped head)")
    ap.add_argument("--work", default=None, help="a training work folder whose held-out records to use")
    ap.add_argument("--per-source", type=int, default=40, help="held-out records per source")
    ap.add_argument("--records", default="heldout", choices=["heldout", "train"],
                    help="train: records the head trained on instead (the gap to held-out says what generalises)")
    ap.add_argument("--bench", type=int, default=4, help="Spec-Bench questions per task (continued by plain decoding)")
    ap.add_argument("--max-answer", type=int, default=256, help="answer tokens kept per sequence")
    ap.add_argument("--tokens", type=int, default=128, help="plain decoding's continuation of a Spec-Bench question")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--weights", default="auto",
                    help="the weights plain decoding continues the Spec-Bench questions with (auto, bf16, q8, q4); "
                         "the scoring pass (features, logits) runs the dense weights, as training's does")
    a = parse(ap)
    from verispec.bench.environment import environment
    from verispec.drafters.dflash import load_dflash_model
    from verispec.drafters.eagle import load_eagle_head
    from verispec.drafters.medusa import load_medusa_heads
    from verispec.engine import Engine
    from verispec.models import load_model
    from verispec.train.data import read_jsonl, split_heldout
    from verispec.train.evaluate import eval_sets, teacher_forced
    from verispec.types import SamplingParams

    target = load_model(a.target, dtype=a.dtype, weights=a.weights)
    module = {"eagle": load_eagle_head, "medusa": load_medusa_heads, "dflash": load_dflash_model}[a.kind](target, a.head)
    sets: dict[str, list[tuple[list[int], list[int]]]] = {}
    if a.work:
        train, held = split_heldout(read_jsonl(Path(a.work) / "answers.jsonl"))
        if a.records == "train":  # a seeded sample: the file's order is the order they were answered in
            import random

            train = random.Random(0).sample(train, len(train))
        for r in held if a.records == "heldout" else train:
            rows = sets.setdefault(f"{a.records}/{r['source']}", [])
            if len(rows) < a.per_source:
                rows.append((list(r["prompt_ids"]), list(r["answer_ids"])[: a.max_answer]))
    plain = Engine.for_model(target, None)
    for task, prompts in eval_sets(target, None, 0, a.bench).items():
        sets[task] = [(p, plain.generate(p, SamplingParams(max_new_tokens=a.tokens)).token_ids) for p in prompts]

    t2d = torch.full((target.vocab_size,), -1, dtype=torch.long)
    t2d[module.d2t.cpu()] = torch.arange(module.d2t.numel())
    out = {"kind": a.kind, "head": a.head or "shipped", "weights": a.weights, "bins": list(BINS[:-1]), "tasks": {}}
    every = []
    for task, seqs in sets.items():
        per_step = None
        for tok, logits, anchors, drafts in teacher_forced(target, a.kind, module, seqs, a.steps):
            n = tok.numel()
            per_step = per_step or [[] for _ in drafts]
            probs = logits.float().softmax(-1)
            for j, lg in enumerate(drafts, start=1):
                at = anchors + j  # the target's distribution of the token at anchor + j + 1
                ok = at < n  # step j reads the true token at anchor + j
                at = at[ok]
                p, want = probs[at].max(-1)
                guess = module.d2t.cpu()[lg[ok].topk(4, dim=-1).indices.cpu()]
                per_step[j - 1].append((p.cpu(), (guess[:, 0] == want.cpu()), (guess == want.cpu()[:, None]).any(-1),
                                        t2d[want.cpu()] < 0))  # outside the draft vocabulary
        if per_step is None:
            continue
        steps = [_summary(j, parts) for j, parts in enumerate(per_step, start=1)]
        for j, parts in enumerate(per_step):
            if len(every) <= j:
                every.append([])
            every[j].extend(parts)
        out["tasks"][task] = {"sequences": len(seqs), "steps": steps}
        s1 = steps[0]
        print(f"{task:28s} step 1: top-1 {s1['top1']:.3f} top-4 {s1['top4']:.3f} target's mean p {s1['mean_p']:.3f} "
              f"oov {s1['oov']:.3f} ({s1['positions']} positions)")
    overall = [_summary(j, parts) for j, parts in enumerate(every, start=1)]
    out["overall"] = overall
    print("overall, step 1, by the target's top-1 probability p:")
    for r in overall[0]["by_p"]:
        print(f"  p in [{r['p'][0]:.1f}, {r['p'][1]:.1f}): share {r['share']:.3f}  top-1 {r['top1']}  top-4 {r['top4']}  oov {r['oov']}")
    print(json.dumps({k: overall[0][k] for k in ("top1", "top4", "oov", "mean_p")}))
    if a.json:
        write_json({**out, "environment": environment(target)}, a.json)


if __name__ == "__main__":
    main()
