"""Self-distillation data: the target's own greedy answers to training prompts, generated in batches.

Prompts come from ShareGPT first turns and GSM8K train (../shared/data), plus long-context tasks built
from the longer ShareGPT texts (summarise, translate, answer about a passage), so the head also trains on
the long prompts that Spec-Bench's summarization and rag tasks bring; evaluation sets (Spec-Bench,
MT-Bench, GSM8K test, HumanEval) are never read here. A fixed slice of ShareGPT_V3_filtered_500 is never
used (`heldout_prompts`), and `split_heldout` holds back a share of every source's answered records.

Answers are written batch by batch to a jsonl file; a rerun skips the prompts already answered.
"""

from __future__ import annotations

import json
import random
import time
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


LONG_TASKS = (
    "Summarize the following text in a few sentences.\n\n{p}",
    "Read the text below, then list its three most important points.\n\n{p}",
    "Translate the following text into {lang}.\n\n{p}",
    "{p}\n\nBased only on the text above, what is the author asking for, and why?",
)
LANGS = ("French", "German", "Spanish", "Chinese", "Italian")


def _long_tasks(passages: list[str], rng: random.Random) -> list[str]:
    """One long-context task per passage (a ShareGPT text of 600+ characters), task and language drawn
    with rng; translations take the first ~600 characters (a long translation outgrows any answer cap)."""
    out = []
    for p in passages:
        task = rng.choice(LONG_TASKS)
        if "{lang}" in task:
            cut = p[:600]
            p = cut[: cut.rfind(". ") + 1] if ". " in cut[200:] else cut
        out.append(task.format(p=p, lang=rng.choice(LANGS)))
    return out


def training_prompts(data_dir: Path, n: int, seed: int = 0, gsm8k_share: float = 0.3,
                     long_share: float = 0.15) -> list[dict]:
    """n prompts ({"id", "source", "text"}): ShareGPT (both files, minus the held-out slice), GSM8K train
    and long-context tasks ("longctx"), shuffled with `seed`, interleaved at fixed shares so that the first
    n prompts of a larger run are this run's prompts. Deterministic for a given data dir, n and seed."""
    sg500 = _sharegpt(data_dir / "sharegpt" / "ShareGPT_V3_filtered_500.json")[:-HELDOUT]
    sg90 = _sharegpt(data_dir / "sharegpt" / "sg_90k_part1_html_cleaned_lang_first_sampled_sorted.json")
    held = set(heldout_prompts(data_dir))
    texts = [t for t in dict.fromkeys(sg500 + sg90) if t not in held]
    chat = [t for t in texts if len(t) < 2000]
    gsm = [json.loads(line)["question"] for line in (data_dir / "gsm8k" / "train.jsonl").read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    rng.shuffle(chat)
    rng.shuffle(gsm)
    long = _long_tasks(sorted(t for t in texts if 600 <= len(t) < 3000), random.Random(seed + 1))
    random.Random(seed + 2).shuffle(long)
    pools = {"gsm8k": gsm, "longctx": long, "sharegpt": chat}
    shares = {"gsm8k": gsm8k_share, "longctx": long_share}
    used = {name: 0 for name in pools}
    items = []
    for i in range(n):
        source = "sharegpt"
        for name, share in shares.items():  # the source furthest behind its share goes next
            if used[name] < int((i + 1) * share) and used[name] < len(pools[name]):
                source = name
                break
        if used[source] >= len(pools[source]):
            left = [name for name in pools if used[name] < len(pools[name])]
            if not left:
                break
            source = left[0]
        items.append({"id": f"{source}-{used[source]}", "source": source, "text": pools[source][used[source]]})
        used[source] += 1
    return items


def split_heldout(records: list[dict], share: float = 0.05) -> tuple[list[dict], list[dict]]:
    """(training records, held-out records): of every source, the ceil(share * count) records whose id
    hashes lowest are held out, so the split is the same whatever order or run answered them, and a
    larger run's held-out set keeps most of a smaller run's."""
    import hashlib
    import math

    def key(r):
        return hashlib.sha1(r["id"].encode()).hexdigest()

    held = set()
    for source in sorted({r["source"] for r in records}):
        mine = sorted((r for r in records if r["source"] == source), key=key)
        held |= {r["id"] for r in mine[: math.ceil(share * len(mine))]}
    return [r for r in records if r["id"] not in held], [r for r in records if r["id"] in held]


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
                     max_new_tokens: int = 192, batch_size: int = 16, log=print, progress: bool = True,
                     max_seconds: float | None = None) -> list[dict]:
    """Greedy answers of `target` (a LoadedModel) to `prompts`, appended to out_path as jsonl records
    {"id", "source", "prompt_ids", "answer_ids"}; prompts already in the file are skipped. With
    `max_seconds` no new batch starts after that much wall time (0: use the answers already in the file),
    so a long self-distillation spreads over several runs."""
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
    pad = getattr(tok, "pad_token_id", None)
    if pad is None:  # any id will do: padded columns are masked and cut off
        pad = min(target.eos_token_ids) if target.eos_token_ids else 0
    eos = sorted(target.eos_token_ids) or None
    out_path.parent.mkdir(parents=True, exist_ok=True)
    it = batches
    if progress:
        from tqdm import tqdm

        it = tqdm(batches, desc="self-distillation", unit="batch")
    t0 = time.perf_counter()
    for n, batch in enumerate(it):
        if max_seconds is not None and time.perf_counter() - t0 >= max_seconds:
            log(f"self-distillation: time budget reached with {len(batches) - n} of {len(batches)} batches left; "
                "a later run resumes them")
            break
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
