"""Self-distillation data: the target's own greedy answers to training prompts, generated in batches.

Prompts come from ShareGPT first turns and GSM8K train (../shared/data); evaluation sets (Spec-Bench,
MT-Bench, GSM8K test, HumanEval) are never read here. A fixed slice of ShareGPT_V3_filtered_500 is held
out (`heldout_prompts`) for the evaluation of mean accepted length on prompts not trained on.

Answers are written batch by batch to a jsonl file; a rerun skips the prompts already answered.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

HELDOUT = 40  # the last HELDOUT prompts of ShareGPT_V3_filtered_500 are never trained on


def default_data_dir() -> Path:
    """Where ../shared/data lives relative to a checkout (or VERISPEC_DATA)."""
    import os

    env = os.environ.get("VERISPEC_DATA")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for parent in here.parents:
        cand = parent.parent / "shared" / "data"
        if cand.is_dir():
            return cand
    return Path("../shared/data")


def _sharegpt(path: Path) -> list[str]:
    out = []
    for rec in json.loads(path.read_text()):
        turns = rec.get("conversations") or []
        if turns and turns[0].get("from") == "human" and turns[0].get("value", "").strip():
            out.append(turns[0]["value"].strip())
    return out


def training_prompts(data_dir: Path, n: int, seed: int = 0, gsm8k_share: float = 0.35) -> list[dict]:
    """n prompts ({"id", "source", "text"}): ShareGPT (both files, minus the held-out slice) and GSM8K
    train, shuffled with `seed`. Deterministic for a given data dir, n and seed."""
    sg500 = _sharegpt(data_dir / "sharegpt" / "ShareGPT_V3_filtered_500.json")[:-HELDOUT]
    sg90 = _sharegpt(data_dir / "sharegpt" / "sg_90k_part1_html_cleaned_lang_first_sampled_sorted.json")
    held = set(heldout_prompts(data_dir))
    chat = [t for t in dict.fromkeys(sg500 + sg90) if t not in held and len(t) < 2000]
    gsm = [json.loads(line)["question"] for line in (data_dir / "gsm8k" / "train.jsonl").read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    rng.shuffle(chat)
    rng.shuffle(gsm)
    # interleaved at a fixed share, so that the first n prompts of a larger run are this run's prompts
    items, c, g = [], 0, 0
    for i in range(n):
        take_gsm = int((i + 1) * gsm8k_share) > int(i * gsm8k_share)
        if (take_gsm and g < len(gsm)) or c >= len(chat):
            if g >= len(gsm):
                break
            items.append({"id": f"gsm8k-{g}", "source": "gsm8k", "text": gsm[g]})
            g += 1
        else:
            items.append({"id": f"sharegpt-{c}", "source": "sharegpt", "text": chat[c]})
            c += 1
    return items


def heldout_prompts(data_dir: Path) -> list[str]:
    return _sharegpt(data_dir / "sharegpt" / "ShareGPT_V3_filtered_500.json")[-HELDOUT:]


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a half-written last line from an interrupted run: regenerate from there
    return out


@torch.inference_mode()
def generate_answers(target, prompts: list[dict], out_path: Path, max_prompt_tokens: int = 384,
                     max_new_tokens: int = 192, batch_size: int = 16, log=print, progress: bool = True) -> list[dict]:
    """Greedy answers of `target` (a LoadedModel) to `prompts`, appended to out_path as jsonl records
    {"id", "source", "prompt_ids", "answer_ids"}; prompts already in the file are skipped."""
    done = {r["id"] for r in read_jsonl(out_path)}
    todo = []
    for p in prompts:
        if p["id"] in done:
            continue
        ids = target.encode(chat=p["text"])
        if len(ids) <= max_prompt_tokens:
            todo.append((p, ids))
    # similar lengths per batch: less padding
    todo.sort(key=lambda x: len(x[1]))
    batches = [todo[i:i + batch_size] for i in range(0, len(todo), batch_size)]
    random.Random(0).shuffle(batches)  # mixed lengths over time, so the progress rate is representative
    model, tok = target.model, target.tokenizer
    pad = tok.pad_token_id if getattr(tok, "pad_token_id", None) is not None else min(target.eos_token_ids)
    eos = sorted(target.eos_token_ids)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    it = batches
    if progress:
        from tqdm import tqdm

        it = tqdm(batches, desc="self-distillation", unit="batch")
    for batch in it:
        width = max(len(ids) for _, ids in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, (_, ids) in enumerate(batch):  # left padding: every row ends at the same column
            input_ids[r, width - len(ids):] = torch.tensor(ids)
            mask[r, width - len(ids):] = 1
        gen = model.generate(input_ids=input_ids.to(target.device), attention_mask=mask.to(target.device),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad)
        with out_path.open("a") as f:
            for r, (p, ids) in enumerate(batch):
                ans = gen[r, width:].tolist()
                cut = next((i for i, t in enumerate(ans) if t in target.eos_token_ids), None)
                ans = ans[: cut + 1] if cut is not None else ans  # keep the EOS: the head learns to predict it
                f.write(json.dumps({"id": p["id"], "source": p["source"], "prompt_ids": ids, "answer_ids": ans}) + "\n")
    return read_jsonl(out_path)
