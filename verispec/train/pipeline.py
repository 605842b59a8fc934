"""`verispec train eagle|medusa`: every stage in order, each skipped when its output exists.

    answers.jsonl          self-distillation (data.py)
    features/shard_*.pt    prefill features + target top-k distributions (extract.py); the layers of
                           both head kinds are extracted, so one data set serves both
    vocab_<size>.pt        the draft vocabulary (vocab.py)
    <kind>/trainer.pt      training state (loops.py), resumed from its last save
    out/                   the exported head (heads/__init__.py format) with its figures in config.json
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from verispec.errors import InvalidParameter

KINDS = ("eagle", "medusa")


@dataclass
class TrainConfig:
    kind: str = "eagle"
    target: str = "smollm2-135m"
    work: str | None = None          # default .verispec-train/<target>
    out: str | None = None           # default <work>/<kind>-head
    prompts: int = 64
    max_prompt_tokens: int = 200
    max_new_tokens: int = 128
    gen_batch: int = 32
    steps: int = 300
    batch_size: int = 4
    seq_len: int = 128
    lr: float = 1e-3
    ttt_steps: int = 3
    draft_vocab: int = 2048
    medusa_heads: int = 4
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"           # the target's dtype for data generation and features (bf16 matmuls
                                     # were 2-5x slower than float32 in transformers on this CPU)
    feature_backend: str = "hf"      # "fast": verispec's own forward extracts the features (extract.py)
    max_minutes: float | None = None # stop training after this much wall time (the steps done are recorded)
    eval_prompts: int = 8
    eval_tokens: int = 64
    threads: int | None = None
    progress: bool = True


def _check(cfg: TrainConfig) -> None:
    if cfg.kind not in KINDS:
        raise InvalidParameter(f"unknown head kind '{cfg.kind}'; use one of {', '.join(KINDS)}")
    for name in ("prompts", "steps", "batch_size", "seq_len", "ttt_steps", "draft_vocab", "medusa_heads", "gen_batch",
                 "max_new_tokens"):
        if getattr(cfg, name) < 1:
            raise InvalidParameter(f"{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.feature_backend not in ("hf", "fast"):
        raise InvalidParameter(f"unknown feature backend '{cfg.feature_backend}'; use hf or fast")
    if cfg.seq_len < cfg.ttt_steps + 2:
        raise InvalidParameter("seq-len must exceed ttt-steps + 1")
    if not cfg.lr > 0:
        raise InvalidParameter(f"lr must be > 0, got {cfg.lr}")


def run(cfg: TrainConfig, log=print) -> dict:
    """Run (or resume) every stage; returns the exported head's config."""
    from verispec.drafters.eagle import EagleDrafter, EagleHead, default_feature_layers
    from verispec.drafters.medusa import MedusaDrafter, MedusaHeads
    from verispec.heads import save_head
    from verispec.models import load_model
    from verispec.train.data import default_data_dir, generate_answers, heldout_prompts, training_prompts
    from verispec.train.evaluate import evaluate_tau
    from verispec.train.extract import FeatureSet, extract_features
    from verispec.train.loops import train_eagle, train_medusa
    from verispec.train.vocab import build_draft_vocab, coverage
    from verispec.tree import DynamicTree

    _check(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    work = Path(cfg.work or Path(".verispec-train") / cfg.target)
    out = Path(cfg.out or work / f"{cfg.kind}-head")
    work.mkdir(parents=True, exist_ok=True)
    target = load_model(cfg.target, dtype=cfg.dtype, device=cfg.device)
    data_dir = default_data_dir()
    timings = {}

    t0 = time.perf_counter()
    prompts = training_prompts(data_dir, cfg.prompts, seed=cfg.seed)
    records = generate_answers(target, prompts, work / "answers.jsonl", max_prompt_tokens=cfg.max_prompt_tokens,
                               max_new_tokens=cfg.max_new_tokens, batch_size=cfg.gen_batch, log=log, progress=cfg.progress)
    keep = {p["id"] for p in prompts}
    records = [r for r in records if r["id"] in keep]
    timings["generate_s"] = round(time.perf_counter() - t0, 1)
    log(f"answers: {len(records)} sequences, {sum(len(r['answer_ids']) for r in records)} answer tokens")

    t0 = time.perf_counter()
    L = int(target.model.config.num_hidden_layers)
    layers = sorted(set(default_feature_layers(L)) | {L})
    paths = extract_features(target, records, work / "features", layers, progress=cfg.progress,
                             backend=cfg.feature_backend)
    data = FeatureSet(paths)
    timings["features_s"] = round(time.perf_counter() - t0, 1)
    log(f"features: {data.num_tokens} positions, layers {layers}")

    vpath = work / f"vocab_{cfg.draft_vocab}.pt"
    if vpath.exists():
        d2t = torch.load(vpath)
    else:
        d2t = build_draft_vocab(records, cfg.draft_vocab, target.vocab_size, always=target.eos_token_ids)
        torch.save(d2t, vpath)
    cov = coverage(records, d2t)
    log(f"draft vocabulary: {d2t.numel()} tokens, {cov:.1%} of answer tokens")

    lm = target.model.get_output_embeddings().weight.detach().float().cpu()
    if cfg.kind == "eagle":
        module = EagleHead(EagleHead.make_config(target, d2t.numel()))
        module.d2t.copy_(d2t)
        with torch.no_grad():  # start from the target's own LM head rows (the head's norm output mimics its final state)
            module.lm_head.weight.copy_(lm[d2t])
        module.attach_embedding(target.model.get_input_embeddings().weight.detach().float().cpu())
    else:
        module = MedusaHeads(MedusaHeads.make_config(target, d2t.numel(), cfg.medusa_heads))
        module.d2t.copy_(d2t)
        module.init_lm_head(lm)
    t0 = time.perf_counter()
    common = dict(max_seconds=cfg.max_minutes * 60 if cfg.max_minutes else None, steps=cfg.steps, batch_size=cfg.batch_size, seq_len=cfg.seq_len, lr=cfg.lr, seed=cfg.seed,
                  device=cfg.device, log=log, progress=cfg.progress)
    if cfg.kind == "eagle":
        history = train_eagle(module, data, target.vocab_size, work / "eagle", ttt_steps=cfg.ttt_steps, **common)
    else:
        history = train_medusa(module, data, target.vocab_size, work / "medusa", **common)
    timings["train_s_this_run"] = round(time.perf_counter() - t0, 1)
    train_seconds = history[-1]["seconds"] if history else 0.0
    tail = history[-20:]
    final_top1 = [round(sum(h["top1"][i] for h in tail) / len(tail), 4) for i in range(len(tail[0]["top1"]))] if tail else []

    module = module.cpu().eval()
    state = {k: v for k, v in module.state_dict().items()}
    config = dict(module.config)
    config["training"] = {
        "command": f"verispec train {cfg.kind} --target {cfg.target} " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in asdict(cfg).items()
            if k not in ("kind", "target", "work", "out", "progress", "threads") and v is not None),
        "stopped_by_time_budget": len(history) < cfg.steps,
        "config": asdict(cfg), "sequences": len(records), "positions": data.num_tokens,
        "answer_tokens": sum(len(r["answer_ids"]) for r in records), "draft_vocab_coverage": round(cov, 4),
        "steps": len(history), "train_seconds_total": train_seconds, "timings_this_run": timings,
        "final_loss": tail[-1]["loss"] if tail else None, "train_top1_by_step_last20": final_top1,
    }
    # held-out figures, on prompts never trained on
    held = heldout_prompts(data_dir)[: cfg.eval_prompts]
    if held:
        module.to(target.device)
        if cfg.kind == "eagle":
            module.attach_embedding(target.model.get_input_embeddings().weight)
            drafter = EagleDrafter(module, target.vocab_size)
        else:
            drafter = MedusaDrafter(module, target.vocab_size)
        fig = {}
        # a fixed budget: the figure measures the head, not this machine's choice of tree size
        for label, tree in (("chain", None), ("dynamic_tree", DynamicTree(budget=16))):
            fig[label] = evaluate_tau(target, drafter, held, max_new_tokens=cfg.eval_tokens, draft_length=4, tree=tree,
                                      check_exact=(label == "chain"))
            log(f"held-out {label}: {json.dumps(fig[label])}")
        fig["heldout_top1"] = heldout_top1(target, module, cfg.kind, held, cfg.eval_tokens)
        log(f"held-out top-1 agreement: {fig['heldout_top1']}")
        config["training"]["heldout"] = {"prompts": len(held), "dtype": cfg.dtype, "max_new_tokens": cfg.eval_tokens, **fig}
        module.cpu()
    save_head(out, config, state)
    log(f"saved the {cfg.kind} head to {out}")
    return config


@torch.inference_mode()
def heldout_top1(target, module, kind: str, prompts: list[str], max_new_tokens: int) -> list[float]:
    """Top-1 agreement of the head with the target on held-out greedy continuations, per draft step
    (EAGLE: step 1 from target features only; Medusa: per head)."""
    from verispec.engine import Engine
    from verispec.train.loops import eagle_unroll
    from verispec.types import SamplingParams

    plain = Engine.for_model(target, None, backend="hf")
    L = int(target.model.config.num_hidden_layers)
    agree, count = None, 0
    for text in prompts:
        ids = target.encode(chat=text)
        ans = plain.generate(ids, SamplingParams(max_new_tokens=max_new_tokens)).token_ids
        seq = torch.tensor([ids + ans], device=target.device)
        out = target.model(input_ids=seq, output_hidden_states=True)
        nxt = out.logits[0].argmax(-1)  # the target's greedy next token at each position
        layers = module.feature_layers
        feats = torch.cat([out.hidden_states[i] for i in layers], dim=-1).float()
        start = len(ids) - 1
        if kind == "eagle":
            outs = eagle_unroll(module, seq, feats, 3)
            rows = [(lg[0].argmax(-1), j) for j, lg in enumerate(outs, start=1)]
        else:
            lg = module(feats[0])  # [T, K, Vd]
            rows = [(lg[:, k].argmax(-1), k + 1) for k in range(lg.shape[1])]
        vals = []
        for pred, shift in rows:  # prediction at anchor t is compared with the target's choice at t + shift
            n = seq.shape[1] - shift
            p = module.d2t[pred[:n]][start: n]
            t = nxt[shift: shift + n][start: n]
            vals.append(((p == t).float().sum().item(), t.numel()))
        agree = vals if agree is None else [(a + b, c + d) for (a, c), (b, d) in zip(agree, vals)]
    return [round(a / max(1, c), 4) for a, c in agree]
