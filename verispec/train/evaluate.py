"""Held-out evaluation of a trained head, as it ships: the real drafter (EAGLE: packed weights in the
target's dtype) on a target loaded in the dtype it runs in, on prompts never trained on.

Per task: mean accepted length (tau) through the engine for a chain and a dynamic tree, acceptance rate,
whether the output equals plain decoding's, and top-1 agreement by draft step (teacher-forced on the
target's own greedy continuation: step j at anchor t is right when the head's argmax is the token the
target emitted at t + j + 1). Tasks: the held-out self-distilled records of each source
(data.split_heldout) and the Spec-Bench questions the bench measures (bench/prompts.py), by task.
"""

from __future__ import annotations

import time

import torch

from verispec.engine import Engine
from verispec.types import SamplingParams


def evaluate_tau(target, drafter, prompts: list, max_new_tokens: int = 64, draft_length: int = 4, tree=None,
                 backend: str = "auto", check_exact: bool = True) -> dict:
    """prompts: chat texts or token-id lists -> {"tau", "steps", "alpha", "prompts", "tokens", "seconds",
    "ar_seconds", "exact", "outputs"} (outputs: the generated ids per prompt)."""
    engine = Engine.for_model(target, drafter, draft_length=draft_length, tree=tree, backend=backend)
    plain = Engine.for_model(target, None, backend=backend)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    steps = tokens = drafted = accepted = 0
    secs = ar_secs = 0.0
    exact = True
    outputs = []
    for p in prompts:
        ids = target.encode(chat=p) if isinstance(p, str) else list(p)
        t0 = time.perf_counter()
        g = engine.generate(ids, params)
        secs += time.perf_counter() - t0
        outputs.append(g.token_ids)
        steps += g.stats.steps
        tokens += g.stats.committed
        drafted += g.stats.drafted
        accepted += g.stats.accepted
        if check_exact:
            t0 = time.perf_counter()
            exact &= plain.generate(ids, params).token_ids == g.token_ids
            ar_secs += time.perf_counter() - t0
    return {"tau": round(tokens / max(1, steps), 3), "steps": steps, "alpha": round(accepted / max(1, drafted), 3),
            "prompts": len(prompts), "tokens": tokens, "seconds": round(secs, 1),
            "ar_seconds": round(ar_secs, 1) if check_exact else None, "exact": exact if check_exact else None,
            "outputs": outputs}


@torch.inference_mode()
def teacher_forced(target, kind: str, module, sequences: list[tuple[list[int], list[int]]], steps: int = 6):
    """sequences: (prompt ids, a continuation) -> per sequence with >= 2 continuation tokens, (tokens [n],
    the target's logits [n, V] over the whole sequence, anchors [A], the head's draft-vocabulary logits per
    draft step, each [A, Vd]): step j at anchor t drafts the token at t + j + 1.
    EAGLE: the training-time unroll on the module as it drafts (its packed copies when packed), so step j
    reads the true tokens and the head's own step j-1 output; Medusa: head j reads the target's state at
    the anchor; dflash: the block forward of train/loops.py (block_logits_for_anchors) at every anchor, so
    step j is block position j."""
    from verispec.drafters.dflash import block_logits_for_anchors
    from verispec.backends import make_runner
    from verispec.train.loops import eagle_unroll

    runner = make_runner(target.model, "auto", exact=False)  # the options go to the fast runner only
    for prompt, answer in sequences:
        seq = prompt + answer
        n, pl = len(seq), len(prompt)
        if n - pl < 2:
            continue
        runner.reset()
        out = runner.forward(torch.tensor(seq, device=target.device), features=tuple(module.feature_layers))
        feats = out.features[None].float()
        tok = torch.tensor([seq], device=target.device)
        anchors = torch.arange(pl - 1, n - 1, device=target.device)[None]  # anchor pl - 1: the first draft
        if kind == "eagle":
            logits = [lg[0] for lg in eagle_unroll(module, tok, feats, steps, anchors)]
        elif kind == "dflash":
            lg = block_logits_for_anchors(module, tok, feats, anchors)[0]  # [A, B-1, Vd]
            logits = [lg[:, j] for j in range(lg.shape[1])]
        else:
            lg = module(feats[0, anchors[0]])  # [A, K, Vd]
            logits = [lg[:, j] for j in range(lg.shape[1])]
        yield tok[0], out.logits, anchors[0], logits


def top1_by_step(target, kind: str, module, sequences: list[tuple[list[int], list[int]]], steps: int = 6) -> list[list[int]]:
    """sequences: (prompt ids, the target's greedy continuation) -> per draft step [agreements, anchors]:
    step j at anchor t is right when the head's argmax is the continuation's token at t + j + 1."""
    depth = steps if kind == "eagle" else module.num_heads if kind == "medusa" else module.block_size - 1
    counts = [[0, 0] for _ in range(depth)]
    for tok, _, anchors, logits in teacher_forced(target, kind, module, sequences, steps):
        n = tok.numel()
        for j, lg in enumerate(logits, start=1):
            label_pos = anchors + j + 1
            ok = label_pos < n
            want = tok[label_pos.clamp_max(n - 1)]
            counts[j - 1][0] += int(((module.d2t[lg.argmax(-1)] == want) & ok).sum())
            counts[j - 1][1] += int(ok.sum())
    return counts


def eval_sets(target, heldout_records: list[dict] | None, per_task: int, bench_per_task: int,
              seed: int = 0) -> dict[str, list[list[int]]]:
    """Prompt ids per task: "heldout/<source>" from held-out records, "spec_bench/<task>" from the
    Spec-Bench public questions (first turns, the bench's seeded choice)."""
    sets: dict[str, list[list[int]]] = {}
    for r in heldout_records or []:
        rows = sets.setdefault(f"heldout/{r['source']}", [])
        if len(rows) < per_task:
            rows.append(list(r["prompt_ids"]))
    if bench_per_task > 0:
        from verispec.bench import prompts as pr

        for q in pr.sample(pr.group_tasks(pr.load_prompts("spec_bench")), bench_per_task, seed=seed):
            sets.setdefault(f"spec_bench/{q.category}", []).append(target.encode(chat=q.turns[0]))
    return sets


def evaluate_head(target, kind: str, module, sets: dict[str, list[list[int]]], max_new_tokens: int = 64,
                  draft_length: int = 5, tree_budget: int = 16, steps: int = 6, log=print) -> dict:
    """The head's figures per task and over all tasks (see the module docstring). `module` is a trained
    EagleHead, MedusaHeads or DFlashModel on the target's device; it is used as the drafter uses it."""
    from verispec.drafters.dflash import DFlashDrafter
    from verispec.drafters.eagle import EagleDrafter
    from verispec.drafters.medusa import MedusaDrafter
    from verispec.tree import DynamicTree, StaticTree

    if kind == "eagle":
        module.attach_embedding(target.model.get_input_embeddings().weight)
        make = lambda: EagleDrafter(module, target.vocab_size, weights_dtype=target.dtype)  # noqa: E731
        tree = DynamicTree(budget=tree_budget, depth=steps)
    elif kind == "dflash":
        module.attach_embedding(target.model.get_input_embeddings().weight)
        make = lambda: DFlashDrafter(module, target.vocab_size, weights_dtype=target.dtype)  # noqa: E731
        tree = DynamicTree(budget=tree_budget, depth=module.block_size - 1)
    else:
        make = lambda: MedusaDrafter(module, target.vocab_size, weights_dtype=target.dtype)  # noqa: E731
        tree = StaticTree.named("medium")
    per_task, total = {}, {"chain": [0, 0], "tree": [0, 0], "top1": None, "exact": True}
    for task, prompts in sets.items():
        chain = evaluate_tau(target, make(), prompts, max_new_tokens, draft_length, None)
        fig = {"prompts": len(prompts), "chain": {k: chain[k] for k in ("tau", "alpha", "exact")}}
        tr = evaluate_tau(target, make(), prompts, max_new_tokens, draft_length, tree, check_exact=False)
        tr["exact"] = tr.pop("outputs") == chain["outputs"]
        fig["tree"] = {k: tr[k] for k in ("tau", "alpha", "exact")}
        total["tree"][0] += tr["tokens"]
        total["tree"][1] += tr["steps"]
        counts = top1_by_step(target, kind, module, list(zip(prompts, chain["outputs"])), steps)
        fig["top1_by_step"] = [round(a / max(1, c), 4) for a, c in counts]
        total["top1"] = counts if total["top1"] is None else [[a + b, c + d] for (a, c), (b, d) in zip(total["top1"], counts)]
        total["chain"][0] += chain["tokens"]
        total["chain"][1] += chain["steps"]
        total["exact"] &= bool(chain["exact"]) and tr["exact"]
        per_task[task] = fig
        log(f"{task}: {fig}")
    overall = {"chain_tau": round(total["chain"][0] / max(1, total["chain"][1]), 3),
               "tree_tau": round(total["tree"][0] / max(1, total["tree"][1]), 3),
               "top1_by_step": [round(a / max(1, c), 4) for a, c in (total["top1"] or [])],
               "exact": total["exact"]}
    return {"dtype": str(target.dtype).replace("torch.", ""), "max_new_tokens": max_new_tokens,
            "draft_length": draft_length, "tree": repr(tree), "overall": overall, "tasks": per_task}
