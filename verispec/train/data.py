"""Self-distillation data: the target's own greedy answers to training prompts, generated in batches.

Prompts come from ShareGPT first turns and GSM8K train (../shared/data), plus long-context tasks built
from the longer ShareGPT texts (summarise, translate, answer about a passage), so the head also trains on
the long prompts that Spec-Bench's summarization and rag tasks bring; evaluation sets (Spec-Bench,
MT-Bench, GSM8K test, HumanEval) are never read here. A fixed slice of ShareGPT_V3_filtered_500 is never
used (`heldout_prompts`), and `split_heldout` holds back a share of every source's answered records.

Answers are decoded many at a time (on verispec's own batched engine where the family has a fast module,
`engine_answers`; else transformers) and appended to a jsonl file; a rerun skips the prompts already
answered. With `loop_ngram` n an answer ends at its first repetition loop: once its last n tokens occurred
earlier in it, the row stops generating and the answer keeps the text up to the loop plus the one repeated
n-gram, so `extract.loop_free_length` still finds where the loop starts and training labels end at the same
token as on the uncut answer; the 135M model's loops otherwise run on to the length cap.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch
from transformers import StoppingCriteria

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


def finish_answer(ans: list[int], eos: set[int], loop_ngram: int) -> tuple[list[int], str]:
    """(answer, how it ended) for a row of generated tokens: up to and including its first EOS ("eos"),
    or, when its first repeated loop_ngram-gram is complete before that, up to the end of that n-gram
    ("loop"); otherwise all of it ("length": the token cap). Tokens after a row stopped (padding, or the
    row's own continuation when the model has no EOS) are dropped."""
    from verispec.train.extract import loop_free_length

    cut = next((i for i, t in enumerate(ans) if t in eos), None)
    head = ans[:cut] if cut is not None else ans
    if loop_ngram:
        start = loop_free_length(head, loop_ngram)
        if start < len(head):
            return ans[: start + loop_ngram], "loop"
    if cut is not None:
        return ans[: cut + 1], "eos"  # keep the EOS: the head learns to predict it
    return ans, "length"


class LoopStop(StoppingCriteria):
    """A per-row stopping criterion for `model.generate` (transformers' StoppingCriteria: called
    after every new token with the (batch, length) ids, returns a (batch,) bool tensor, True where the row
    is done): a row is done once the last `n` tokens of its answer (the ids from column `start` on)
    occurred earlier in that answer. Each n-gram is looked at once, as it completes."""

    def __init__(self, start: int, n: int, rows: int):
        self.start, self.n = start, n
        self.seen: list[set[tuple[int, ...]]] = [set() for _ in range(rows)]
        self.done = torch.zeros(rows, dtype=torch.bool)
        self.next = 0  # the first answer position whose n-gram is not looked at yet

    def __call__(self, input_ids: torch.Tensor, scores=None, **kwargs) -> torch.Tensor:
        last = input_ids.shape[1] - self.start - self.n  # the newest complete n-gram's position
        if last >= self.next:
            block = input_ids[:, self.start + self.next:].tolist()
            for r, row in enumerate(block):
                if self.done[r]:
                    continue
                for k in range(last - self.next + 1):
                    g = tuple(row[k:k + self.n])
                    if g in self.seen[r]:
                        self.done[r] = True
                        break
                    self.seen[r].add(g)
            self.next = last + 1
        return self.done.to(input_ids.device)


@torch.inference_mode()
def greedy_compacting(model, input_ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, eos: set[int],
                      loop_ngram: int = 0) -> list[list[int]]:
    """Greedy continuations of a left-padded batch (ids and attention mask), one list of tokens per row,
    each ending at its first EOS (kept), its first repeated loop_ngram-gram (`finish_answer`'s rule) or
    after max_new_tokens. A row that ended leaves the batch at once: its rows of the KV cache, mask and
    positions are dropped, so the steps after it cost only the rows still going. Positions count each
    row's real tokens from 0, as transformers' generate does for a left-padded batch."""
    from transformers import DynamicCache

    out: list[list[int]] = [[] for _ in range(input_ids.shape[0])]
    seen: list[set[tuple[int, ...]]] = [set() for _ in out]
    alive = list(range(len(out)))  # the original row of each batch row
    cache = DynamicCache(config=model.config)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                   logits_to_keep=1).logits[:, -1]
    pos = pos[:, -1:] + 1
    for _ in range(max_new_tokens):
        toks = logits.argmax(-1).tolist()
        keep = []
        for j, (r, t) in enumerate(zip(alive, toks)):
            ans = out[r]
            ans.append(t)
            done = t in eos or len(ans) >= max_new_tokens
            if loop_ngram and not done and len(ans) >= loop_ngram:
                g = tuple(ans[-loop_ngram:])
                done = g in seen[r]
                seen[r].add(g)
            if not done:
                keep.append(j)
        if not keep:
            break
        if len(keep) < len(alive):
            idx = torch.tensor(keep, device=mask.device)
            cache.batch_select_indices(idx)
            mask, pos = mask[idx], pos[idx]
            alive = [alive[j] for j in keep]
        step = torch.tensor([[out[r][-1]] for r in alive], device=mask.device)
        mask = torch.cat([mask, mask.new_ones(len(alive), 1)], dim=1)
        logits = model(input_ids=step, attention_mask=mask, position_ids=pos, cache=cache,
                       use_cache=True).logits[:, -1]
        pos = pos + 1
    return out


DECODERS = ("auto", "engine", "compact", "generate")


def engine_answers(target, todo: list[tuple[dict, list[int]]], write, max_new_tokens: int, batch_size: int,
                   loop_ngram: int = 0, deadline: float | None = None, progress: bool = True) -> int:
    """Greedy answers on verispec's own engine (batch.Batch over fast-path runners, exact mode), continuous:
    up to batch_size sequences share every target forward, and the place of one that ended goes to the
    next prompt at once. Exact mode makes each answer the one its prompt gets alone, bit for bit, whatever
    shares its forwards. write(prompt, prompt_ids, answer_ids, end) as each answer ends (`finish_answer`'s rule: a
    row stops at its first EOS, repeated loop_ngram-gram or max_new_tokens); no prompt starts after
    `deadline` (time.perf_counter()). -> the number of prompts started."""
    from verispec.backends import make_runner
    from verispec.batch import Batch, continuous
    from verispec.engine import Engine
    from verispec.types import SamplingParams

    longest = max((len(ids) for _, ids in todo), default=0) + max_new_tokens + 1
    params = SamplingParams(max_new_tokens=max_new_tokens)
    engines = [Engine.for_model(target, None, backend="fast",
                                runner=make_runner(target.model, "fast", capacity=longest, exact=True))
               for _ in range(min(batch_size, len(todo)))]
    jobs = [(n, ids, params) for n, (_, ids) in enumerate(todo)]
    admit = None if deadline is None else (lambda: time.perf_counter() < deadline)
    seen: dict[int, set[tuple[int, ...]]] = {}  # per answer: its n-grams so far
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(todo), desc="self-distillation", unit="answer")
    batch, started = Batch(max_batch=max(1, len(engines))), set()
    for n, run in continuous(batch, engines, jobs, admit):
        started.add(n)
        if loop_ngram and not run.finished:  # one token a step: the newest n-gram is the only new one
            gram = tuple(run.out.out[-loop_ngram:])
            if len(gram) == loop_ngram:
                if gram in seen.setdefault(n, set()):
                    batch.cancel(run)
                seen[n].add(gram)
        if run.finished:
            seen.pop(n, None)
            tokens = run.out.context[len(run.prompt_ids):]  # what it committed, its EOS included
            write(todo[n][0], run.prompt_ids, *finish_answer(tokens[:max_new_tokens], target.eos_token_ids, loop_ngram))
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return len(started)


@torch.inference_mode()
def generate_answers(target, prompts: list[dict], out_path: Path, max_prompt_tokens: int = 384,
                     max_new_tokens: int = 192, batch_size: int = 16, log=print, progress: bool = True,
                     max_seconds: float | None = None, loop_ngram: int = 0, decoder: str = "auto") -> list[dict]:
    """Greedy answers of `target` (a LoadedModel) to `prompts`, appended to out_path as jsonl records
    {"id", "source", "prompt_ids", "answer_ids", "end"}, end "eos", "loop" or "length" (`finish_answer`);
    prompts already in the file are skipped. With `loop_ngram` n > 0 a row stops at its first repeated
    n-gram. decoder: "engine" (`engine_answers`: verispec's batched fast path, continuous admission),
    "compact" (`greedy_compacting` on transformers: a row that ended leaves its batch, the batch is not
    refilled), "generate" (transformers' `generate` with a `LoopStop` criterion: an ended row runs on as
    padding until every row of its batch ended), "auto": engine where the family has a fast module, else
    compact. With `max_seconds` no new batch (engine: no new prompt) starts after that much wall time (0:
    use the answers already in the file), so a long self-distillation spreads over several runs."""
    from verispec.errors import InvalidParameter
    from verispec.fast import supports

    if decoder not in DECODERS:
        raise InvalidParameter(f"unknown decoder '{decoder}'; use one of {', '.join(DECODERS)}")
    if decoder == "auto":
        decoder = "engine" if supports(target.model) else "compact"
    done = {r["id"] for r in read_jsonl(out_path)}
    todo = []
    for p in prompts:
        if p["id"] in done:
            continue
        ids = target.encode(chat=p["text"])
        if len(ids) <= max_prompt_tokens:
            todo.append((p, ids))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if decoder == "engine":
        t0 = time.perf_counter()
        with out_path.open("a") as f:
            def write(p, ids, ans, end):
                f.write(json.dumps({"id": p["id"], "source": p["source"], "prompt_ids": ids, "answer_ids": ans,
                                    "end": end}) + "\n")
                f.flush()  # an interrupted run keeps every answer that ended

            started = engine_answers(target, todo, write, max_new_tokens,
                                     batch_size, loop_ngram, None if max_seconds is None else t0 + max_seconds,
                                     progress)
        if started < len(todo):
            log(f"self-distillation: time budget reached with {len(todo) - started} of {len(todo)} prompts left; "
                "a later run resumes them")
        return read_jsonl(out_path)
    # similar lengths per batch: less padding
    todo.sort(key=lambda x: len(x[1]))
    batches = [todo[i:i + batch_size] for i in range(0, len(todo), batch_size)]
    random.Random(0).shuffle(batches)  # mixed lengths over time, so the progress rate is representative
    model, tok = target.model, target.tokenizer
    pad = getattr(tok, "pad_token_id", None)
    if pad is None:  # any id will do: padded columns are masked and cut off
        pad = min(target.eos_token_ids) if target.eos_token_ids else 0
    eos = sorted(target.eos_token_ids) or None
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
        input_ids, mask = input_ids.to(target.device), mask.to(target.device)
        if decoder == "compact":
            rows = greedy_compacting(model, input_ids, mask, max_new_tokens, target.eos_token_ids, loop_ngram)
        else:
            stop = {}
            if loop_ngram:
                from transformers import StoppingCriteriaList

                stop["stopping_criteria"] = StoppingCriteriaList([LoopStop(width, loop_ngram, len(batch))])
            rows = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                  eos_token_id=eos, pad_token_id=pad, **stop)[:, width:].tolist()
        with out_path.open("a") as f:
            for r, (p, ids) in enumerate(batch):
                ans, end = finish_answer(rows[r], target.eos_token_ids, loop_ngram)
                f.write(json.dumps({"id": p["id"], "source": p["source"], "prompt_ids": ids, "answer_ids": ans,
                                    "end": end}) + "\n")
    return read_jsonl(out_path)
