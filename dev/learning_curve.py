"""Held-out mean accepted length of a trained head against the number of training positions.

Runs `verispec train <kind>` (verispec/train/pipeline.py) once per point on the first shards of the same
self-distilled data (--max-positions), each point with its own training state in the work folder and the
same steps, then plots held-out tau (chain and dynamic tree) and top-1 agreement by draft step against
positions (--reference: the shipped head scored on the same sets, as lines). Flat curves say the data is
not what limits the head (capacity, training compute or a mismatch between training and drafting); rising
ones say more data pays. Every point resumes; points already in --json with the same steps are kept.

    gunzip -c train-data/smollm2-135m/answers.jsonl.gz > .verispec-train/lc/answers.jsonl
    .venv/bin/python -m dev.learning_curve --work .verispec-train/lc --prompts 3199 --layout eagle3 \\
        --points 30000 60000 120000 240000 --steps 200 --threads 1 --reference --json results/zen3/training/eagle-learning-curve.json
"""

from __future__ import annotations

import json
from pathlib import Path
from verispec.bench.script import options, write_json


def main() -> None:
    ap = options(__doc__, threads=None, json=True)
    ap.add_argument("--kind", default="eagle")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--work", required=True, help="a work folder whose answers and features exist (or will be made)")
    ap.add_argument("--prompts", type=int, default=4000)
    ap.add_argument("--points", type=int, nargs="+", required=True, help="training positions per point")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--eval-prompts", type=int, default=4)
    ap.add_argument("--eval-bench", type=int, default=1)
    ap.add_argument("--layout", default="verispec", help="eagle: the head's layer layout (verispec or eagle3)")
    ap.add_argument("--gen-minutes", type=float, default=0.0,
                    help="self-distillation budget before the first point (0: the answers already in the work folder)")
    ap.add_argument("--reference", action="store_true",
                    help="also score the shipped head on the same held-out sets (a line on the plot)")
    a = ap.parse_args()  # --threads goes to the training run, which sets it
    from verispec.train.pipeline import TrainConfig, run

    reference = _reference(a) if a.reference else None
    done = {}  # points of an earlier run of this curve with the same steps: not trained or scored again
    if a.json and Path(a.json).exists():
        done = {r["max_positions"]: r for r in json.loads(Path(a.json).read_text()).get("points", []) if r["steps"] == a.steps}
    rows = []
    for p in sorted(a.points):
        if p in done:
            rows.append(done[p])
            continue
        cfg = TrainConfig(kind=a.kind, target=a.target, work=a.work, out=str(Path(a.work) / "curve" / f"{a.kind}-{p}"),
                          prompts=a.prompts, gen_minutes=a.gen_minutes, layout=a.layout, steps=a.steps, batch_size=a.batch_size, max_positions=p,
                          eval_prompts=a.eval_prompts, eval_bench=a.eval_bench, threads=a.threads, feature_backend="fast",
                          progress=False)
        config = run(cfg, log=lambda m: print(m, flush=True))
        t = config["training"]
        rows.append({"max_positions": p, "positions": t["positions"], "sequences": t["sequences"], "steps": t["steps"],
                     "heldout": t["heldout"]["overall"], "tasks": t["heldout"]["tasks"]})
        write_json({"points": rows, "reference": reference}, a.json)
    _plot(rows, Path(a.json).with_suffix(".png"), a.kind, reference)


def _reference(a) -> dict:
    """The shipped head's held-out figures on the sets every point is scored on (the same held-out records:
    the split depends on the record ids only), with its own training recorded beside them; kept in the work
    folder (curve/reference.json) once scored."""
    import torch

    cache = Path(a.work) / "curve" / "reference.json"
    if cache.exists():
        return json.loads(cache.read_text())

    from verispec.drafters.eagle import load_eagle_head
    from verispec.heads import resolve_head
    from verispec.models import load_model
    from verispec.train.data import default_data_dir, read_jsonl, training_prompts
    from verispec.train.evaluate import eval_sets, evaluate_head
    from verispec.train.pipeline import TrainConfig, split_for

    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = TrainConfig()
    prompts = training_prompts(default_data_dir(), a.prompts, seed=cfg.seed)
    _, heldout = split_for(prompts, read_jsonl(Path(a.work) / "answers.jsonl"), cfg.heldout_share)
    target = load_model(a.target, dtype="bfloat16")
    sets = eval_sets(target, heldout, a.eval_prompts, a.eval_bench, seed=cfg.seed)
    figures = evaluate_head(target, "eagle", load_eagle_head(target), sets, max_new_tokens=64, steps=6,
                            log=lambda m: print(m, flush=True))
    training = json.loads((resolve_head(target, "eagle", None) / "config.json").read_text())["training"]
    out = {"head": "shipped", "positions": training["positions"], "sequences": training["sequences"],
           "steps": training["steps"], "heldout": figures["overall"], "tasks": figures["tasks"]}
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(out))
    return out


def _plot(rows: list[dict], path: Path, kind: str, reference: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["positions"] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(x, [r["heldout"]["chain_tau"] for r in rows], "o-", label="chain of 5")
    ax[0].plot(x, [r["heldout"]["tree_tau"] for r in rows], "s-", label="tree")
    if reference:
        for key, style in (("chain_tau", "C0"), ("tree_tau", "C1")):
            ax[0].axhline(reference["heldout"][key], color=style, ls="--", lw=1)
        ax[0].plot([], [], "k--", lw=1, label=f"shipped head ({reference['positions']} positions, {reference['steps']} steps)")
    ax[0].set(xscale="log", xlabel="training positions", ylabel="held-out tau (tokens / forward)", title=f"{kind} head")
    ax[0].legend()
    for j in range(len(rows[0]["heldout"]["top1_by_step"])):
        ax[1].plot(x, [r["heldout"]["top1_by_step"][j] for r in rows], "o-", label=f"step {j + 1}")
    ax[1].set(xscale="log", xlabel="training positions", ylabel="held-out top-1 agreement")
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
