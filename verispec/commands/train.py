"""`verispec train eagle|medusa|dflash --target M ...`: train a drafter head by self-distillation (resumable)."""

from __future__ import annotations

import os
from typing import Optional

import typer

from verispec.commands import friendly

train_app = typer.Typer(no_args_is_help=True, help="Train drafter heads (EAGLE-style, Medusa, DFlash) for a target model.")


def _run(kind: str, **options) -> None:
    from verispec.train.pipeline import TrainConfig, run

    cfg = TrainConfig(kind=kind, **options)
    config = run(cfg, log=lambda m: typer.echo(m, err=True))
    if int(os.environ.get("RANK", "0")) > 0:
        return  # a torchrun rank other than 0: rank 0 evaluates, saves and reports
    t = config["training"]
    held = t.get("heldout", {}).get("overall", {})
    typer.echo(f"{kind} head: {t['steps']} steps, {t['train_seconds_total']:.0f} s training, "
               f"{t['sequences']} sequences; held-out tau chain {held.get('chain_tau')}, "
               f"tree {held.get('tree_tau')}, top-1 by step {held.get('top1_by_step')}")


def _command(kind: str):
    @train_app.command(kind, help=f"Train the {kind} head for --target (stages resume from --work).")
    @friendly
    def cmd(
        target: str = typer.Option("smollm2-135m", "--target", "-m", help="The target model (embedded name, folder, .gguf)."),
        work: Optional[str] = typer.Option(None, "--work", help="Work folder for data and training state (default .verispec-train/<target>)."),
        out: Optional[str] = typer.Option(None, "--out", help="Where to write the head (default <work>/<kind>-head)."),
        prompts: int = typer.Option(64, "--prompts", help="Training prompts (ShareGPT + GSM8K train)."),
        max_prompt_tokens: int = typer.Option(640, "--max-prompt-tokens", help="Skip longer prompts."),
        max_new_tokens: int = typer.Option(512, "--max-new-tokens", help="Answer cap for self-distillation (answers end at EOS below it)."),
        gen_batch: int = typer.Option(32, "--gen-batch", help="Prompts per batched generate call."),
        gen_minutes: Optional[float] = typer.Option(None, "--gen-minutes", help="Self-distillation time budget for this run (0 = train on the answers so far; a later run resumes)."),
        steps: int = typer.Option(300, "--steps", help="Optimizer steps."),
        batch_size: int = typer.Option(4, "--batch-size"),
        seq_len: int = typer.Option(128, "--seq-len", help="Answer anchors per training window (every earlier position is a key)."),
        lr: float = typer.Option(1e-3, "--lr"),
        ttt_steps: int = typer.Option(6, "--ttt-steps", help="EAGLE: training-time test unroll steps."),
        draft_vocab: int = typer.Option(2048, "--draft-vocab", help="Reduced draft vocabulary size."),
        medusa_heads: int = typer.Option(4, "--medusa-heads", help="Medusa: number of heads."),
        layout: str = typer.Option("verispec", "--layout", help="EAGLE: verispec (own layer) or eagle3 (EAGLE-3's layer; verispec export writes it for vLLM / SGLang)."),
        block_size: int = typer.Option(8, "--block-size", help="dflash: block length (the pending token + block-size - 1 drafted tokens)."),
        dflash_layers: int = typer.Option(2, "--dflash-layers", help="dflash: drafter layers."),
        head_intermediate: Optional[int] = typer.Option(None, "--head-intermediate", help="EAGLE: the head's MLP width (default: the target's intermediate size)."),
        head_layers: int = typer.Option(1, "--head-layers", help="EAGLE: decoder layers (the first reads the target's features; plain ones follow)."),
        feature_layers: Optional[str] = typer.Option(None, "--feature-layers", help="EAGLE, dflash: the target's hidden states read, e.g. 3,16,30 (i = output of decoder layer i - 1; the layer count = the final normed state; default: a low, a middle and a high layer)."),
        init: Optional[str] = typer.Option(None, "--init", help="A trained head folder (same kind, sizes and records) whose weights start the training; an EAGLE head with fewer layers grows into --head-layers (the new ones start as identity)."),
        block_anchors: int = typer.Option(32, "--block-anchors", help="dflash: blocks per sequence and step (random anchors among the window's --seq-len)."),
        seed: int = typer.Option(0, "--seed"),
        device: str = typer.Option("cpu", "--device", help="cpu, cuda or auto."),
        dtype: str = typer.Option("float32", "--dtype", help="Target dtype for data generation and features."),
        feature_backend: str = typer.Option("hf", "--feature-backend", help="hf (transformers) or fast (verispec's forward) for the feature pass."),
        max_minutes: Optional[float] = typer.Option(None, "--max-minutes", help="Stop training after this much training time in all (a resumed run counts the time before it; the learning rate anneals by then)."),
        loop_ngram: int = typer.Option(16, "--loop-ngram", help="Self-distillation stops an answer once it repeats an earlier n-gram of this length, and training uses only the tokens before the repeat (0: neither)."),
        train_precision: str = typer.Option("auto", "--train-precision", help="auto (bf16 autocast where the CPU has bf16 units), bfloat16 or float32."),
        heldout_share: float = typer.Option(0.05, "--heldout-share", help="Share of every source's answers held out, never trained on."),
        eval_prompts: int = typer.Option(4, "--eval-prompts", help="Held-out prompts per source in the held-out figures."),
        eval_bench: int = typer.Option(2, "--eval-bench", help="Spec-Bench questions per task in the held-out figures (0 = none)."),
        eval_tokens: int = typer.Option(64, "--eval-tokens"),
        eval_dtype: str = typer.Option("bfloat16", "--eval-dtype", help="The target dtype of the held-out figures (the head drafts in it)."),
        max_positions: Optional[int] = typer.Option(None, "--max-positions", help="Train on the first feature shards up to this many positions (a learning-curve point)."),
        threads: Optional[int] = typer.Option(None, "--threads", help="torch CPU threads."),
        no_progress: bool = typer.Option(False, "--no-progress", help="No progress bars."),
    ):
        options = dict(locals())  # the parameters, named as TrainConfig's fields (and `kind`, a free variable)
        options.pop("kind", None)
        options["progress"] = not options.pop("no_progress")
        _run(kind, **options)

    return cmd


eagle = _command("eagle")
medusa = _command("medusa")
dflash = _command("dflash")
