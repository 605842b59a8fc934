"""The reduced draft vocabulary: the most frequent tokens of the training answers (FR-Spec, EAGLE-3).

A head's LM head covers only these ids (d2t: draft index -> target id), so drafting costs a fraction of
the target's LM head; tokens outside it are simply never drafted (the target still emits them, so the
output is unchanged). EOS ids are always included; remaining room goes to prompt tokens, then low ids.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path

import torch


def build_draft_vocab(records: list[dict], size: int, vocab: int, always: set[int] = frozenset()) -> torch.Tensor:
    """LongTensor [min(size, vocab)] of target ids, most frequent answer tokens first."""
    size = min(size, vocab)
    answers = Counter(t for r in records for t in r["answer_ids"])
    prompts = Counter(t for r in records for t in r["prompt_ids"])
    chosen = [t for t in sorted(always) if t < vocab]
    seen = set(chosen)
    for counter in (answers, prompts):
        for t, _ in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0])):
            if len(chosen) >= size:
                break
            if t not in seen and t < vocab:
                chosen.append(t)
                seen.add(t)
    t = 0
    while len(chosen) < size:
        if t not in seen:
            chosen.append(t)
            seen.add(t)
        t += 1
    return torch.tensor(chosen[:size], dtype=torch.long)


def coverage(records: list[dict], d2t: torch.Tensor) -> float:
    """Share of answer tokens inside the draft vocabulary."""
    inside = set(d2t.tolist())
    total = sum(len(r["answer_ids"]) for r in records)
    return sum(1 for r in records for t in r["answer_ids"] if t in inside) / max(1, total)


def records_fingerprint(records: list[dict]) -> str:
    """A hash of the records' ids and lengths: what a draft vocabulary was built from."""
    h = hashlib.sha1()
    for r in sorted(records, key=lambda r: r["id"]):
        h.update(f"{r['id']}:{len(r['prompt_ids'])}:{len(r['answer_ids'])};".encode())
    return h.hexdigest()[:16]


def draft_vocab_for(path: Path, records: list[dict], size: int, vocab: int, always: set[int] = frozenset()):
    """The draft vocabulary saved at `path` when it was built from these records, else built anew and
    saved there -> (d2t, the records' fingerprint). A run with more or other data gets a vocabulary of
    its own data, not the one an earlier run left in the work folder."""
    fingerprint = records_fingerprint(records)
    saved = torch.load(path) if Path(path).exists() else None
    if isinstance(saved, dict) and saved.get("records") == fingerprint and saved["d2t"].numel() == min(size, vocab):
        return saved["d2t"], fingerprint
    d2t = build_draft_vocab(records, size, vocab, always=always)
    torch.save({"d2t": d2t, "records": fingerprint}, path)
    return d2t, fingerprint
