"""What drafting with a trained head costs against the target's forward, side by side in one run.

For the shipped EAGLE head (as it drafts: EagleDrafter.for_target, packed weights in the target's dtype)
and the shipped Medusa heads, after a context of --context tokens:
  * one target forward over 1 position (the fast runner, exact mode as greedy decoding runs it, and not exact)
  * one EAGLE draft step: the head forward of one tree level (--nodes nodes, default 1 and 4) plus its
    logits over the draft vocabulary, i.e. what one depth of a chain or a dynamic tree costs
  * one whole EAGLE proposal: a chain of 5, and a dynamic tree (budget 16, top-k 4, depth 6)
  * the same three for every other EAGLE head named by --eagle-head (a trained candidate, a deeper one)
  * one Medusa proposal (a chain of 4 and the static medium tree)
  * with --python-steps, the same EAGLE, Medusa and DFlash-drafter items the way they ran before their native
    steps and Medusa's packed copies: the head layers' operations issued from Python, Medusa from its float32
    parameters (suffix "[python]")
  * one DFlash-drafter (dflash) proposal: the block forward alone, and with the context entries of 3
    newly accepted positions first (what a step does), for --dflash-layers x --dflash-blocks drafters
    (the shipped one when there is one, else random weights: the cost does not depend on them)
Every figure is the median over --rounds rounds that measure every item once (the machine is shared).

    .venv/bin/python -m dev.head_cost --dtype bfloat16 --weights auto --json results/<machine-kind>/heads/head_cost.json
"""

from __future__ import annotations

import statistics
import time

import torch
from verispec.bench.script import options, parse, write_json


def _ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


@torch.inference_mode()
def main() -> None:
    ap = options(__doc__, model="smollm2-135m", dtype="bfloat16", threads=None, json=None)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--weights", default="auto", choices=["auto", "bf16", "q8", "q4"],
                    help="the target's weights format (auto: the file's q4 where qmm runs); quantized targets' heads run 8-bit")
    ap.add_argument("--eagle-head", nargs="+", default=[], help="other EAGLE head folders, timed beside the shipped one")
    ap.add_argument("--dflash-layers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dflash-blocks", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--python-steps", action="store_true",
                    help="also time the heads' Python steps (no native call) and Medusa from its float32 parameters")
    a = parse(ap)
    from verispec.drafters.eagle import EagleDrafter
    from verispec.drafters.medusa import MedusaDrafter
    from verispec.backends.fast import FastRunner
    from verispec.bench.environment import environment
    from verispec.models import load_model
    from verispec.tree import DynamicTree, StaticTree
    from verispec.types import SamplingParams

    from verispec.fast import quant

    target = load_model(a.model, dtype=a.dtype, weights=a.weights)
    fmt = quant.target_format(target)  # the target's weights format; the heads' linears follow it
    print(f"target weights: {fmt}")
    ctx = torch.randint(100, 20000, (a.context,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams()
    runners = {}
    for label, exact in (("exact", True), ("not_exact", False)):
        r = FastRunner(target.model, exact=exact, weights=fmt, weight_source=target.weight_source)
        r.reset(params)
        runners[label] = r
    eagle = EagleDrafter.for_target(target)
    medusa = MedusaDrafter.for_target(target)
    feat_runner = FastRunner(target.model, exact=False)
    feature_layers = tuple(sorted(set(eagle.feature_layers) | set(medusa.feature_layers)))
    feats = feat_runner.forward(torch.tensor(ctx), features=feature_layers).features
    cols = {}
    H = int(target.model.config.hidden_size)
    for name, layers in (("eagle", eagle.feature_layers), ("medusa", medusa.feature_layers)):
        idx = [feature_layers.index(i) for i in layers]
        cols[name] = torch.cat([torch.arange(i * H, (i + 1) * H) for i in idx])

    def target_step(label):
        r = runners[label]
        r.rollback(a.context)
        r.forward(torch.tensor([ctx[-1]]))

    for r in runners.values():
        r.forward(torch.tensor(ctx))

    def eagle_items(drafter, name):
        drafter.begin(ctx, params, None)
        drafter.observe_features(feats[:-1, cols["eagle"]])
        h = drafter.sync(ctx)

        def draft_level(m):
            drafter.scratch = drafter.n
            out = drafter._expand(ctx[-m:], h[None].expand(m, -1), 1, [[] for _ in range(m)])
            vals, idx = drafter.ranking(drafter.head.logits(out)).topk(4, dim=-1)  # the tree builder's top-k step
            drafter.d2t[idx].tolist(), vals.tolist()

        got = {f"{name}_draft_step_{m}_nodes": (lambda m=m: draft_level(m)) for m in a.nodes}
        got[f"{name}_chain_5"] = lambda: drafter.propose(ctx, 5)
        got[f"{name}_dynamic_tree_16"] = lambda: drafter.propose_tree(ctx, DynamicTree(budget=16, topk=4, depth=6))
        return got

    medusa.begin(ctx, params, None)
    medusa.observe_features(feats[:-1, cols["medusa"]])
    items = {f"target_forward_1pos_{k}": (lambda k=k: target_step(k)) for k in runners}
    items.update(eagle_items(eagle, "eagle"))
    if a.python_steps:
        slow = EagleDrafter.for_target(target, native=False)
        items.update({f"{k}[python]": v for k, v in eagle_items(slow, "eagle").items()})
    for path in a.eagle_head:
        items.update(eagle_items(EagleDrafter.for_target(target, path), f"eagle[{path.rstrip('/').split('/')[-1]}]"))
    items["medusa_chain_4"] = lambda: medusa.propose(ctx, 4)
    items["medusa_static_medium"] = lambda: medusa.propose_tree(ctx, StaticTree.named("medium"))
    if a.python_steps:
        from verispec.drafters.medusa import load_medusa_heads

        plain = MedusaDrafter(load_medusa_heads(target), target.vocab_size)  # no packed copies
        plain.begin(ctx, params, None)
        plain.observe_features(feats[:-1, cols["medusa"]])
        items["medusa_chain_4[python]"] = lambda: plain.propose(ctx, 4)
        items["medusa_static_medium[python]"] = lambda: plain.propose_tree(ctx, StaticTree.named("medium"))
    from verispec.drafters.dflash import DFlashDrafter, DFlashModel
    from verispec.heads import shipped_head

    shipped = shipped_head(target.name, "dflash")
    for layers in a.dflash_layers:
        for block in a.dflash_blocks:
            model = DFlashModel(DFlashModel.make_config(target, eagle.d2t.numel(), block, layers, eagle.feature_layers))
            model.attach_embedding(target.model.get_input_embeddings().weight)
            d = DFlashDrafter(model.to(target.device).eval(), target.vocab_size, weights_dtype=target.dtype,
                             quantized=fmt != "bf16")
            d.begin(ctx, params, None)
            d.observe_features(feats[:-1, cols["eagle"]])
            d.block_logits(ctx)

            def sync_and_block(d=d):
                d.n -= 3  # the last 3 entries again, as after a step that accepted 2 drafts
                d.observe_features(feats[-4:-1, cols["eagle"]])
                d.propose(ctx, block - 1)

            items[f"dflash_{layers}L_b{block}_block"] = lambda d=d, block=block: d.propose(ctx, block - 1)
            items[f"dflash_{layers}L_b{block}_step"] = sync_and_block
    if shipped is not None:
        d = DFlashDrafter.for_target(target)
        d.begin(ctx, params, None)
        d.observe_features(feats[:-1, cols["eagle"]])
        items["dflash_shipped_block"] = lambda: d.propose(ctx, d.positions)
        items["dflash_shipped_dynamic_tree_16"] = lambda: d.propose_tree(ctx, DynamicTree(budget=16, topk=4, depth=d.positions))
        if a.python_steps:
            slow_d = DFlashDrafter.for_target(target, native=False)
            slow_d.begin(ctx, params, None)
            slow_d.observe_features(feats[:-1, cols["eagle"]])
            items["dflash_shipped_block[python]"] = lambda: slow_d.propose(ctx, slow_d.positions)
            items["dflash_shipped_dynamic_tree_16[python]"] = lambda: slow_d.propose_tree(
                ctx, DynamicTree(budget=16, topk=4, depth=slow_d.positions))
    for fn in items.values():  # warm-up
        fn()
    rounds = {k: [] for k in items}
    for _ in range(a.rounds):
        for k, fn in items.items():
            rounds[k].append(_ms(fn, a.repeat))
    ms = {k: round(statistics.median(v), 3) for k, v in rounds.items()}
    base = ms["target_forward_1pos_exact"]
    ratios = {k: round(v / base, 3) for k, v in ms.items()}
    out = {"model": a.model, "dtype": a.dtype, "weights": fmt, "context": a.context, "ms": ms, "ratio_to_target_forward_exact": ratios,
           "environment": environment(target)}
    for k in items:
        print(f"{k:32s} {ms[k]:8.2f} ms  {ratios[k]:6.3f}x target forward (exact)")
    if a.json:
        write_json(out, a.json)


if __name__ == "__main__":
    main()
