"""Held-out mean accepted length of a trained head against the number of training positions.

Runs `verispec train <kind>` (verispec/train/pipeline.py) once per point on the first shards of the same
self-distilled data (--max-positions), each point with its own training state in the work folder and the
same steps, then plots held-out tau (chain and dynamic tree) and step-1 top-1 agreement against
positions. Flat curves say the data is not what limits the head (capacity, training compute or a
mismatch between training and drafting); rising ones say more data pays. Every point resumes.

    gunzip -c train-data/smollm2-135m/answers.jsonl.gz > .verispec-train/lc/answers.jsonl
    .venv/bin/python benchmarks/learning_curve.py --work .verispec-train/lc --prompts 3199 --layout eagle3 \\
        --points 30000 60000 120000 240000 --steps 200 --threads 1 --json results/cpu/eagle-learning-curve.json
"""

from __future__ import annotations

from pathlib import Path
from _common import options, write_json


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
    a = ap.parse_args()  # --threads goes to the training run, which sets it
    from verispec.train.pipeline import TrainConfig, run

    rows = []
    for p in sorted(a.points):
        cfg = TrainConfig(kind=a.kind, target=a.target, work=a.work, out=str(Path(a.work) / "curve" / f"{a.kind}-{p}"),
                          prompts=a.prompts, gen_minutes=a.gen_minutes, layout=a.layout, steps=a.steps, batch_size=a.batch_size, max_positions=p,
                          eval_prompts=a.eval_prompts, eval_bench=a.eval_bench, threads=a.threads, feature_backend="fast",
                          progress=False)
        config = run(cfg, log=lambda m: print(m, flush=True))
        t = config["training"]
        rows.append({"max_positions": p, "positions": t["positions"], "sequences": t["sequences"], "steps": t["steps"],
                     "heldout": t["heldout"]["overall"], "tasks": t["heldout"]["tasks"]})
        write_json({"points": rows}, a.json)
    _plot(rows, Path(a.json).with_suffix(".png"), a.kind)


def _plot(rows: list[dict], path: Path, kind: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["positions"] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(x, [r["heldout"]["chain_tau"] for r in rows], "o-", label="chain of 5")
    ax[0].plot(x, [r["heldout"]["tree_tau"] for r in rows], "s-", label="tree")
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
