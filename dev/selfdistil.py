"""Self-distillation on its own (train/data.generate_answers), outside `verispec train`, which goes on to
features and training after generation.

`measure`: answers/hour on the same new training prompts (never answered in the committed answers file)
for several settings NGRAM:BATCH:DECODER, side by side in one process: loop-ngram 0 generates to EOS or
the cap, 16 stops each answer at its first repeated 16-gram; decoder "generate" is transformers'
generate (a batch runs until all its rows ended), "compact" data.greedy_compacting (an ended row leaves
the batch), "engine" data.engine_answers (verispec's batched fast path; an ended row's place goes to the
next prompt). Each answer is checked to be a prefix of the same prompt's answer in the first setting.

    OMP_NUM_THREADS=1 .venv/bin/python -m dev.selfdistil measure --prompts 32 --threads 1 \\
        --settings 0:32:generate 16:32:generate 16:32:compact --json results/xeon/training/selfdistil-loopstop.json

`grow`: append answers to new prompts of the training mix (data.training_prompts, the first --pool of
them; prompts already in the file are skipped) until --minutes are spent (no batch starts after that).

    gunzip -c train-data/smollm2-135m/answers.jsonl.gz > work/answers.jsonl
    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python -m dev.selfdistil grow --answers work/answers.jsonl \\
        --pool 4000 --minutes 60 --threads 1
"""

from __future__ import annotations

import gzip
import json
import tempfile
import time
from pathlib import Path

from verispec.bench.script import command_line, options, parse, write_json


def _committed_ids(path: Path) -> set[str]:
    if not path.exists():
        return set()
    with gzip.open(path, "rt") as f:
        return {json.loads(line)["id"] for line in f if line.strip()}


def main() -> None:
    ap = options(__doc__, model="smollm2-135m", dtype="float32", threads=None, json=None)
    ap.add_argument("mode", choices=["measure", "grow"])
    ap.add_argument("--prompts", type=int, default=32, help="measure: how many new prompts")
    ap.add_argument("--settings", nargs="+", default=["0:32:generate", "16:32:compact"],
                    help="measure: loop-ngram:batch:decoder (engine, compact or generate)")
    ap.add_argument("--committed", default="train-data/smollm2-135m/answers.jsonl.gz",
                    help="answers whose prompts measure leaves out")
    ap.add_argument("--answers", default=None, help="grow: the jsonl file to append to")
    ap.add_argument("--pool", type=int, default=4000, help="grow: answer among the first POOL training prompts")
    ap.add_argument("--minutes", type=float, default=None, help="grow: no new batch starts after this long")
    ap.add_argument("--loop-ngram", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--decoder", default="auto", help="grow: the decoder (auto, engine, compact or generate)")
    ap.add_argument("--max-prompt-tokens", type=int, default=640)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    a = parse(ap)
    import torch

    from verispec.models import load_model
    from verispec.train.data import DECODERS, default_data_dir, generate_answers, training_prompts
    from verispec.train.extract import loop_free_length

    for decoder in [a.decoder] + [x.split(":")[-1] for x in a.settings]:
        if decoder not in DECODERS:
            ap.error(f"unknown decoder '{decoder}'; use one of {', '.join(DECODERS)}")
    target = load_model(a.model, dtype=a.dtype)
    data_dir = default_data_dir()
    common = dict(max_prompt_tokens=a.max_prompt_tokens, max_new_tokens=a.max_new_tokens)
    if a.mode == "grow":
        if not a.answers:
            ap.error("grow needs --answers")
        out = Path(a.answers)
        before = sum(1 for line in out.open() if line.strip()) if out.exists() else 0
        t0 = time.perf_counter()
        recs = generate_answers(target, training_prompts(data_dir, a.pool), out, batch_size=a.batch,
                                max_seconds=a.minutes * 60 if a.minutes is not None else None,
                                loop_ngram=a.loop_ngram, decoder=a.decoder, **common)
        hours = (time.perf_counter() - t0) / 3600
        print(f"grow: {len(recs) - before} new answers in {hours * 60:.1f} min, {len(recs)} in {out}", flush=True)
        return

    done = _committed_ids(Path(a.committed))
    prompts = []
    for p in training_prompts(data_dir, a.pool):
        if p["id"] not in done and len(target.encode(chat=p["text"])) <= a.max_prompt_tokens:
            prompts.append(p)
        if len(prompts) == a.prompts:
            break
    runs, ref = [], None
    for setting in a.settings:
        n, batch, decoder = setting.split(":")
        n, batch = int(n), int(batch)
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            recs = generate_answers(target, prompts, Path(tmp) / "a.jsonl", batch_size=batch, progress=False,
                                    loop_ngram=n, decoder=decoder, log=lambda m: None, **common)
            sec = time.perf_counter() - t0
        ends = {e: sum(r["end"] == e for r in recs) for e in ("eos", "loop", "length")}
        run = {"loop_ngram": n, "batch": batch, "decoder": decoder, "answers": len(recs), "seconds": round(sec, 1),
               "answers_per_hour": round(len(recs) / sec * 3600, 1), "ends": ends,
               "answer_tokens": sum(len(r["answer_ids"]) for r in recs),
               # the positions --loop-ngram 16 trains on: answer tokens before the first repeated 16-gram
               "loop_free_tokens_16": sum(loop_free_length(r["answer_ids"], 16) for r in recs)}
        run["loop_free_tokens_16_per_hour"] = round(run["loop_free_tokens_16"] / sec * 3600)
        if ref is None:
            ref = {r["id"]: r["answer_ids"] for r in recs}
        else:  # how many answers are the first setting's answer to the prompt, or a prefix of it
            run["prefix_of_first_settings_answer"] = sum(r["answer_ids"] == ref[r["id"]][: len(r["answer_ids"])] for r in recs)
        print(json.dumps(run), flush=True)
        runs.append(run)
    base = runs[0]
    for run in runs[1:]:
        run["answers_per_hour_ratio_vs_first"] = round(run["answers_per_hour"] / base["answers_per_hour"], 2)
    fig = {"command": command_line(), "model": a.model, "dtype": a.dtype, "threads": torch.get_num_threads(),
           "prompts": [p["id"] for p in prompts], "max_new_tokens": a.max_new_tokens, "runs": runs}
    if a.json:
        write_json(fig, a.json)


if __name__ == "__main__":
    main()
