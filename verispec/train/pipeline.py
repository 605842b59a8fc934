"""`verispec train eagle|medusa|dflash`: every stage in order, each skipped when its output exists.

    answers.jsonl          self-distillation (data.py)
    features/shard_*.pt    prefill features + target top-k distributions (extract.py); the layers of
                           both head kinds are extracted, so one data set serves both
    vocab_<size>.pt        the draft vocabulary (vocab.py), rebuilt when the training records change
    <kind>/trainer.pt      training state (loops.py), resumed from its last save
    out/                   the exported head (heads/__init__.py format) with its figures in config.json
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from verispec.errors import InvalidParameter

KINDS = ("eagle", "medusa", "dflash")


SHARD_SIZE = 32  # records per feature shard (extract.py), the unit a learning curve's points are cut in


@dataclass
class TrainConfig:
    kind: str = "eagle"
    target: str = "smollm2-135m"
    work: str | None = None          # default .verispec-train/<target>
    out: str | None = None           # default <work>/<kind>-head
    prompts: int = 64
    max_prompt_tokens: int = 640
    max_new_tokens: int = 512        # answers run to their natural end (EOS) below this cap
    gen_batch: int = 32
    gen_minutes: float | None = None # self-distillation time budget for this run (0: train on the answers so far)
    steps: int = 300
    batch_size: int = 4
    seq_len: int = 128
    lr: float = 1e-3
    ttt_steps: int = 6               # as deep as a dynamic tree drafts
    draft_vocab: int = 2048
    medusa_heads: int = 4
    layout: str = "verispec"         # eagle: "eagle3" trains EAGLE-3's layer (exportable to vLLM / SGLang)
    block_size: int = 8              # dflash: the pending token + block_size - 1 drafted positions
    dflash_layers: int = 2           # dflash: drafter layers
    head_intermediate: int | None = None  # eagle: the head's MLP width (default: the target's)
    head_layers: int = 1             # eagle: decoder layers (the first reads the features; plain ones follow)
    feature_layers: str | None = None  # eagle, dflash: the target's hidden states read ("3,16,30"; default low, middle, high)
    block_anchors: int = 32          # dflash: blocks per sequence and step, drawn among the window's seq-len anchors
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"           # the target's dtype for data generation and features (bf16 matmuls
                                     # were slower than float32 in transformers; docs/performance-notes.md)
    feature_backend: str = "hf"      # "fast": verispec's own forward extracts the features (extract.py)
    max_minutes: float | None = None # training time over all resumed runs; the learning rate anneals by then
    loop_ngram: int = 16             # an answer stops generating once it repeats an earlier n-gram, and its
                                     # labels end where that repetition starts (0: neither)
    train_precision: str = "auto"    # the training forward's autocast: auto = bf16 where the CPU has bf16 units
    max_positions: int | None = None # train on the first feature shards up to this many positions (a
                                     # learning curve's point); its training state is kept apart
    heldout_share: float = 0.05      # of every source's records, never trained on (data.split_heldout)
    init: str | None = None          # a trained head folder whose weights start the training
    eval_prompts: int = 4            # held-out prompts per task (held-out sources and Spec-Bench tasks)
    eval_bench: int = 2              # Spec-Bench questions per task in the held-out figures (0: none)
    eval_tokens: int = 64
    eval_dtype: str = "bfloat16"     # the dtype the head ships and drafts in
    threads: int | None = None
    progress: bool = True


def parse_layers(text: str) -> list[int]:
    """"3,16,30" -> [3, 16, 30] (transformers' hidden-state numbering: i = output of decoder layer i - 1; the
    number of layers = the final normed state), or InvalidParameter. The range is checked against the
    target once it is loaded (feature_layers_for)."""
    try:
        layers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        layers = []
    if not layers or len(set(layers)) != len(layers) or min(layers) < 1:
        raise InvalidParameter(f"feature-layers takes distinct hidden-state indices >= 1 separated by commas, "
                               f"such as 3,16,30; got '{text}'")
    return layers


def feature_layers_for(cfg: TrainConfig, num_hidden_layers: int) -> list[int] | None:
    """The head's feature layers (None: its default), checked against the target's depth."""
    if cfg.feature_layers is None:
        return None
    layers = parse_layers(cfg.feature_layers)
    if max(layers) > num_hidden_layers:
        raise InvalidParameter(f"feature-layers: the target has hidden states 1..{num_hidden_layers}, not {max(layers)}")
    return layers


def _check(cfg: TrainConfig) -> None:
    if cfg.kind not in KINDS:
        raise InvalidParameter(f"unknown head kind '{cfg.kind}'; use one of {', '.join(KINDS)}")
    for name in ("prompts", "steps", "batch_size", "seq_len", "ttt_steps", "draft_vocab", "medusa_heads", "gen_batch", "dflash_layers",
                 "block_anchors",
                 "max_new_tokens"):
        if getattr(cfg, name) < 1:
            raise InvalidParameter(f"{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.init is not None and not Path(cfg.init).is_dir():
        raise InvalidParameter(f"init: no head folder at '{cfg.init}'; give a folder with config.json and model.safetensors")
    if cfg.head_intermediate is not None and cfg.kind != "eagle":
        raise InvalidParameter(f"head-intermediate sets the EAGLE head's MLP width; a {cfg.kind} head does not take it")
    if cfg.head_layers != 1 and cfg.kind != "eagle":
        raise InvalidParameter(f"head-layers sets the EAGLE head's depth; a {cfg.kind} head does not take it "
                               "(the DFlash drafter's is dflash-layers)")
    if cfg.head_layers < 1:
        raise InvalidParameter(f"head-layers must be >= 1, got {cfg.head_layers}")
    if cfg.feature_layers is not None:
        if cfg.kind == "medusa":
            raise InvalidParameter("feature-layers sets what an EAGLE head or DFlash drafter reads; Medusa heads read "
                                   "the final hidden state")
        parse_layers(cfg.feature_layers)
    if cfg.head_intermediate is not None and cfg.head_intermediate < 1:
        raise InvalidParameter(f"head-intermediate must be >= 1, got {cfg.head_intermediate}")
    if cfg.layout not in ("verispec", "eagle3"):
        raise InvalidParameter(f"unknown layout '{cfg.layout}'; use verispec or eagle3")
    if cfg.block_size < 2:
        raise InvalidParameter(f"block-size must be >= 2 (the pending token and one drafted position), got {cfg.block_size}")
    if cfg.feature_backend not in ("hf", "fast"):
        raise InvalidParameter(f"unknown feature backend '{cfg.feature_backend}'; use hf or fast")
    if cfg.seq_len < cfg.ttt_steps + 2:
        raise InvalidParameter("seq-len must exceed ttt-steps + 1")
    if not cfg.lr > 0:
        raise InvalidParameter(f"lr must be > 0, got {cfg.lr}")
    if cfg.gen_minutes is not None and cfg.gen_minutes < 0:
        raise InvalidParameter(f"gen-minutes must be >= 0, got {cfg.gen_minutes}")
    if cfg.loop_ngram < 0:
        raise InvalidParameter(f"loop-ngram must be >= 0, got {cfg.loop_ngram}")
    if cfg.train_precision not in ("auto", "bfloat16", "float32"):
        raise InvalidParameter(f"unknown train precision '{cfg.train_precision}'; use auto, bfloat16 or float32")
    if cfg.max_positions is not None and cfg.max_positions < 1:
        raise InvalidParameter(f"max-positions must be >= 1, got {cfg.max_positions}")
    if not 0 < cfg.heldout_share < 1:
        raise InvalidParameter(f"heldout-share must be in (0, 1), got {cfg.heldout_share}")


def run(cfg: TrainConfig, log=print) -> dict:
    """Run (or resume) every stage; returns the exported head's config."""
    from verispec.drafters.dflash import DFlashModel
    from verispec.drafters.eagle import EagleHead, default_feature_layers
    from verispec.drafters.medusa import MedusaDrafter, MedusaHeads
    from verispec.heads import save_head
    from verispec.models import load_model
    from verispec.train.data import default_data_dir, generate_answers, training_prompts
    from verispec.train.evaluate import eval_sets, evaluate_head
    from verispec.train.extract import FeatureSet, extract_features
    from verispec.train.loops import train_dflash, train_eagle, train_medusa
    from verispec.train.vocab import coverage, draft_vocab_for

    from verispec.train import distributed
    from verispec.train.data import read_jsonl

    _check(cfg)
    return_freed_memory()
    cfg = replace(cfg, device=distributed.init(cfg.device))  # under torchrun: join the group (one GPU per rank)
    rank, world = distributed.rank(), distributed.world()
    if rank:
        log = lambda m: None  # noqa: E731 - rank 0 speaks for all
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
    gen = dict(max_prompt_tokens=cfg.max_prompt_tokens, max_new_tokens=cfg.max_new_tokens, batch_size=cfg.gen_batch,
               log=log, progress=cfg.progress and rank == 0,
               max_seconds=cfg.gen_minutes * 60 if cfg.gen_minutes is not None else None, loop_ngram=cfg.loop_ngram)
    answers = work / "answers.jsonl"
    if world > 1:  # rank r answers prompts r, r + W, ... into its own part; rank 0 appends the parts in rank order
        have = {r["id"] for r in read_jsonl(answers)}
        generate_answers(target, [p for p in prompts if p["id"] not in have][rank::world], work / f"answers.rank{rank}.jsonl", **gen)
        distributed.barrier()
        if rank == 0:
            with answers.open("a") as f:
                for r in range(world):
                    part = work / f"answers.rank{r}.jsonl"
                    f.writelines(json.dumps(x) + "\n" for x in read_jsonl(part) if x["id"] not in have)
                    part.unlink()
        distributed.barrier()
        gen["max_seconds"] = 0  # what is left was left by the ranks' time budgets
    records, heldout = split_for(prompts, generate_answers(target, prompts, answers, **gen), cfg.heldout_share)
    timings["generate_s"] = round(time.perf_counter() - t0, 1)
    log(f"answers: {len(records)} sequences for training, {len(heldout)} held out, "
        f"{sum(len(r['answer_ids']) for r in records)} training answer tokens")

    t0 = time.perf_counter()
    L = int(target.model.config.num_hidden_layers)
    feature_layers = feature_layers_for(cfg, L)
    layers = sorted(set(default_feature_layers(L)) | {L} | set(feature_layers or ()))
    if cfg.max_positions:  # a learning curve's point: the first shards only, and only they are extracted
        records = records[: records_within(records, cfg.max_positions, SHARD_SIZE)]
    paths = extract_features(target, records, work / "features", layers, progress=cfg.progress and rank == 0,
                             backend=cfg.feature_backend, part=(rank, world), shard_size=SHARD_SIZE)
    distributed.barrier()  # every rank's shards are written
    data = FeatureSet(paths, loop_ngram=cfg.loop_ngram)
    timings["features_s"] = round(time.perf_counter() - t0, 1)
    log(f"features: {data.num_tokens} positions, layers {layers}; "
        f"{sum(e - p for e, p in zip(data.ends, data.prompt_lengths))} answer positions before loops")

    if rank:
        distributed.barrier()  # rank 0 writes the vocabulary file first; the others read it
    d2t, fingerprint = draft_vocab_for(work / f"vocab_{cfg.draft_vocab}.pt", records, cfg.draft_vocab, target.vocab_size,
                                       always=target.eos_token_ids)
    if rank == 0:
        distributed.barrier()
    cov = coverage(records, d2t)
    log(f"draft vocabulary: {d2t.numel()} tokens, {cov:.1%} of answer tokens")

    lm = target.model.get_output_embeddings().weight.detach().float().cpu()
    if cfg.kind in ("eagle", "dflash"):
        module = (EagleHead(EagleHead.make_config(target, d2t.numel(), feature_layers, layout=cfg.layout,
                                                        intermediate_size=cfg.head_intermediate,
                                                        num_layers=cfg.head_layers)) if cfg.kind == "eagle" else
                  DFlashModel(DFlashModel.make_config(target, d2t.numel(), cfg.block_size, cfg.dflash_layers,
                                                                  feature_layers)))
        module.d2t.copy_(d2t)
        with torch.no_grad():  # start from the target's own LM head rows and final norm, which the head mimics
            module.lm_head.weight.copy_(lm[d2t])
            module.norm.weight.copy_(final_norm_scale(target.model))
        module.attach_embedding(target.model.get_input_embeddings().weight.detach().float().cpu())
    else:
        module = MedusaHeads(MedusaHeads.make_config(target, d2t.numel(), cfg.medusa_heads))
        module.d2t.copy_(d2t)
        module.init_lm_head(lm)
    t0 = time.perf_counter()
    state = cfg.kind + ("-eagle3" if cfg.kind == "eagle" and cfg.layout == "eagle3" else "")  # another layer, another state
    if cfg.head_intermediate:  # another width, another state
        state += f"-mlp{cfg.head_intermediate}"
    if cfg.head_layers != 1:
        state += f"-layers{cfg.head_layers}"
    if feature_layers is not None:  # other features, another state
        state += "-f" + "-".join(map(str, feature_layers))
    if cfg.init:
        start_from(module, Path(cfg.init), d2t, target)
        state += f"-from-{Path(cfg.init).name}"
    state = state if not cfg.max_positions else f"{state}-{cfg.max_positions}"
    common = dict(max_seconds=cfg.max_minutes * 60 if cfg.max_minutes else None, steps=cfg.steps, batch_size=cfg.batch_size, seq_len=cfg.seq_len, lr=cfg.lr, seed=cfg.seed,
                  device=cfg.device, log=log, progress=cfg.progress, autocast=cfg.train_precision)
    if cfg.kind == "eagle":
        history = train_eagle(module, data, target.vocab_size, work / state, ttt_steps=cfg.ttt_steps, **common)
    elif cfg.kind == "dflash":
        history = train_dflash(module, data, target.vocab_size, work / state, anchors=cfg.block_anchors, **common)
    else:
        history = train_medusa(module, data, target.vocab_size, work / state, **common)
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
        "draft_vocab_records": fingerprint, "heldout_records": len(heldout),
        "steps": len(history), "train_seconds_total": train_seconds, "timings_this_run": timings,
        "final_loss": tail[-1]["loss"] if tail else None, "train_top1_by_step_last20": final_top1,
    }
    if rank:  # rank 0 evaluates and saves the head
        distributed.close()
        return config
    # held-out figures, on prompts never trained on, with the head as it ships
    if cfg.eval_prompts > 0 or cfg.eval_bench > 0:
        t0 = time.perf_counter()
        evaluated = target if cfg.eval_dtype == cfg.dtype else load_model(cfg.target, dtype=cfg.eval_dtype, device=cfg.device)
        sets = eval_sets(evaluated, heldout, cfg.eval_prompts, cfg.eval_bench, seed=cfg.seed)
        module.to(evaluated.device)
        chain = {"draft_length": cfg.block_size - 1} if cfg.kind == "dflash" else {}  # the whole block: drafted at once
        config["training"]["heldout"] = evaluate_head(evaluated, cfg.kind, module, sets, max_new_tokens=cfg.eval_tokens,
                                                      steps=max(cfg.ttt_steps, 6), log=log, **chain)
        timings["eval_s"] = round(time.perf_counter() - t0, 1)
        log(f"held-out overall: {json.dumps(config['training']['heldout']['overall'])}")
        module.cpu()
    save_head(out, config, state)
    log(f"saved the {cfg.kind} head to {out}")
    distributed.close()
    return config


def start_from(module, head: Path, d2t: torch.Tensor, target) -> None:
    """Start training from the weights of a trained head of the same kind and shape, whose draft vocabulary
    is the one rebuilt here (a longer or a fine-tuning run on the records it was trained on). An EAGLE head
    with more layers than the saved one grows from it: its first layers take the saved ones and the
    layers past them start as identity (DecoderLayer.start_as_identity), so it starts drafting what the
    saved head drafted."""
    from verispec.heads import read_head

    config, tensors = read_head(head, module.config["kind"], target)
    if "d2t" in tensors and not torch.equal(tensors["d2t"].long(), d2t.long()):
        raise InvalidParameter(f"the head at '{head}' drafts another vocabulary than the one these records give; "
                               "train it from scratch, or from a head trained on the same records")
    saved_layers = [int(i) for i in config.get("feature_layers", [])]
    if "feature_layers" in module.config and saved_layers != [int(i) for i in module.config["feature_layers"]]:
        raise InvalidParameter(f"the head at '{head}' reads the target's hidden states {saved_layers}, not "
                               f"{module.config['feature_layers']}; give --feature-layers as it was trained")
    have, want = int(config.get("num_layers", 1)), int(module.config.get("num_layers", 1))
    grown = range(have - 1, want - 1) if module.config["kind"] == "eagle" else range(0)
    new = tuple(f"layers.{i}." for i in grown)
    try:
        missing, unexpected = module.load_state_dict(
            {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, strict=False)
        left = [k for k in missing if not k.startswith(new)] if have < want else missing
        if left or unexpected:
            raise RuntimeError(f"missing {left}, unexpected {unexpected}")
    except RuntimeError as e:  # other tensors or other shapes
        raise InvalidParameter(f"the head at '{head}' does not fit the head being trained "
                               f"({str(e).splitlines()[-1].strip()}); give a head of the same layout and sizes") from None
    for i in grown:
        module.layers[i].start_as_identity()


def return_freed_memory() -> bool:
    """Make glibc hand large freed blocks back to the system (mmap above 128 KiB, trim above 128 KiB).
    Training windows change shape every step; with glibc's default adaptive thresholds the freed blocks
    of one shape were kept and fragmented, and a training process grew until the kernel killed it.
    Returns whether the allocator took the setting (False off glibc)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
        return bool(libc.mallopt(m_mmap_threshold, 128 * 1024)) and bool(libc.mallopt(m_trim_threshold, 128 * 1024))
    except (OSError, AttributeError):
        return False


def split_for(prompts: list[dict], records: list[dict], share: float) -> tuple[list[dict], list[dict]]:
    """(training records, held-out records) among the answers to `prompts` (data.split_heldout: by record id,
    so every run over the same prompts holds out the same records)."""
    from verispec.train.data import split_heldout

    keep = {p["id"] for p in prompts}
    return split_heldout([r for r in records if r["id"] in keep], share)


def records_within(records: list[dict], positions: int, shard_size: int) -> int:
    """How many of the first records fill the first feature shards (of shard_size records) that together hold
    at most `positions` positions (prompt and answer tokens); at least one shard."""
    total, n = 0, min(shard_size, len(records))
    for i in range(0, len(records), shard_size):
        total += sum(len(r["prompt_ids"]) + len(r["answer_ids"]) for r in records[i:i + shard_size])
        if total > positions:
            break
        n = min(i + shard_size, len(records))
    return n


def final_norm_scale(model) -> torch.Tensor:
    """The effective scale of the target's final RMSNorm (Gemma's norms scale by 1 + weight)."""
    norm = model.get_decoder().norm if hasattr(model, "get_decoder") else model.model.norm
    w = norm.weight.detach().float().cpu()
    return 1.0 + w if str(getattr(model.config, "model_type", "")).startswith("gemma") else w
