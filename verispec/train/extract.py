"""Prefill passes over prompt + answer: the target's hidden features and next-token distributions.

For every training sequence, one forward of the target (batched, right-padded) keeps
  feats     [T, len(layers) * hidden]  hidden states at the requested indices (transformers' numbering:
                                       i = output of decoder layer i - 1; num_hidden_layers = final normed)
  topk_ids  [T, k], topk_p [T, k]      the target's next-token distribution at each position, top k
                                       (the tail is dropped: the loss renormalises over what is kept)
Shards of `shard_size` sequences are saved as they finish (shard_XXXX.pt), so a rerun skips them.
Processes that extract into one folder at once (two trainings of different kinds on one work folder)
share the work: a process claims a shard by an advisory lock on shard_XXXX.lock (released by the OS
when the process ends, however it ends), passes over the shards others hold, and at the end waits for
them, computing any that their holder left unfinished.

Two backends: "hf" runs transformers' forward on right-padded batches; "fast" runs verispec's own forward
(fast/runner.py, not exact) one sequence at a time, and gives the features the drafter reads when it
drafts on the fast path; it is also the faster one, most of all in bfloat16 (positions per second in
docs/performance-notes.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
from pathlib import Path

import torch


@torch.inference_mode()
def extract_features(target, records: list[dict], out_dir: Path, layers: list[int], topk: int = 8,
                     batch_size: int = 8, shard_size: int = 32, progress: bool = True, backend: str = "hf",
                     part: tuple[int, int] = (0, 1)) -> list[Path]:
    """Feature shards of `records` in out_dir -> every shard's path. part = (rank, world): this process
    computes shards s with s % world == rank only (torchrun ranks share the work; the caller waits for
    the others before reading theirs)."""
    if backend not in ("hf", "fast"):
        raise ValueError(f"unknown feature backend {backend!r}; use 'hf' or 'fast'")
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = str(target.dtype).removeprefix("torch.")  # the features' and labels' source precision
    shards = [records[i:i + shard_size] for i in range(0, len(records), shard_size)]
    paths = [out_dir / f"shard_{s:04d}.pt" for s in range(len(shards))]
    it = range(len(shards))
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc="features", unit="shard")
    runner = None  # the fast backend's runner, built when a shard needs it (a rerun may need none)

    def make(s: int) -> None:
        """Shard s, unless a finished one with the same records, layers, backend and dtype is there."""
        nonlocal runner
        path = paths[s]
        ids = [r["id"] for r in shards[s]]
        if path.exists():
            old = torch.load(path)
            if (old.get("ids") == ids and old["layers"] == list(layers) and old.get("backend", "hf") == backend
                    and old.get("dtype", "float32") == dtype):
                return  # done before; a shard whose records, backend or the target's dtype changed is redone
        seqs = [r["prompt_ids"] + r["answer_ids"] for r in shards[s]]
        if backend == "fast" and runner is None:
            from verispec.backends.fast import FastRunner

            longest = max(len(r["prompt_ids"]) + len(r["answer_ids"]) for r in records)
            runner = FastRunner(target.model, capacity=longest, exact=False)
        if runner is not None:
            rows = [_fast_rows(runner, x, tuple(layers), topk) for x in seqs]
        else:
            rows = [row for b in range(0, len(seqs), batch_size) for row in _hf_rows(target, seqs[b:b + batch_size], layers, topk)]
        toks = [torch.tensor(x, dtype=torch.int32) for x in seqs]
        feats, tops, ps = (list(col) for col in zip(*rows))
        tmp = path.with_suffix(".tmp")
        torch.save({"ids": ids, "backend": backend, "dtype": dtype, "layers": list(layers), "tokens": torch.cat(toks),
                    "lengths": torch.tensor([len(x) for x in seqs]),
                    "prompt_lengths": torch.tensor([len(r["prompt_ids"]) for r in shards[s]]),
                    "feats": torch.cat(feats), "topk_ids": torch.cat(tops), "topk_p": torch.cat(ps)}, tmp)
        tmp.replace(path)

    held = []  # shards another process was making when this one came to them
    for s in it:
        if s % part[1] != part[0]:
            continue
        with claim(out_dir / f"shard_{s:04d}.lock", wait=False) as mine:
            if mine:
                make(s)
            else:
                held.append(s)
    for s in held:
        with claim(out_dir / f"shard_{s:04d}.lock", wait=True):
            make(s)  # finished by its holder (skipped), or left unfinished (made here)
    return paths


@contextlib.contextmanager
def claim(lock: Path, wait: bool):
    """An exclusive advisory lock on the file `lock` for the block -> True, or False at once where another
    process holds it and not `wait`. Unlike a lock file's mere existence, it ends with its process."""
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def loop_free_length(answer: list[int], n: int) -> int:
    """How many leading tokens of `answer` come before it starts repeating itself: the start of the first
    n-gram that already occurred earlier in the answer (len(answer) when none does). Greedy answers of a
    small model that run to the length cap mostly end in such loops; training on them teaches the head
    to continue loops, which the answers people read rarely contain."""
    seen = set()
    for i in range(len(answer) - n + 1):
        g = tuple(answer[i:i + n])
        if g in seen:
            return i
        seen.add(g)
    return len(answer)


def _fast_rows(runner, seq: list[int], layers: tuple[int, ...], topk: int):
    """One sequence through verispec's fast forward -> (features bf16, top-k ids int32, top-k probs fp16)."""
    runner.reset()
    logits, feats = runner.forward(torch.tensor(seq, device=runner.device), features=layers)
    p, i = logits.float().softmax(-1).topk(topk, dim=-1)
    return feats.to(torch.bfloat16).cpu(), i.to(torch.int32).cpu(), p.to(torch.float16).cpu()


def _hf_rows(target, chunk: list[list[int]], layers: list[int], topk: int):
    """A right-padded batch through transformers' forward -> per sequence, as _fast_rows."""
    width = max(len(x) for x in chunk)
    inp = torch.zeros(len(chunk), width, dtype=torch.long)
    mask = torch.zeros(len(chunk), width, dtype=torch.long)
    for r, x in enumerate(chunk):
        inp[r, : len(x)] = torch.tensor(x)
        mask[r, : len(x)] = 1
    out = target.model(input_ids=inp.to(target.device), attention_mask=mask.to(target.device), output_hidden_states=True)
    hs = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
    p, i = out.logits.float().softmax(-1).topk(topk, dim=-1)
    return [(hs[r, :len(x)].to(torch.bfloat16).cpu(), i[r, :len(x)].to(torch.int32).cpu(), p[r, :len(x)].to(torch.float16).cpu())
            for r, x in enumerate(chunk)]


class FeatureSet:
    """Every shard's tokens, labels and offsets in memory; the features (the bulk: thousands of bytes a
    position) stay in their shard files, memory-mapped, so a data set larger than the machine's memory
    trains from the page cache."""

    def __init__(self, paths: list[Path], loop_ngram: int = 0):
        parts = [torch.load(p, mmap=True) for p in paths]
        if not parts:
            raise ValueError("no feature shards to train on")
        self.layers = parts[0]["layers"]
        self.tokens = torch.cat([p["tokens"] for p in parts]).long()
        self.topk_ids = torch.cat([p["topk_ids"] for p in parts]).long()
        self.topk_p = torch.cat([p["topk_p"] for p in parts]).float()
        self.lengths = torch.cat([p["lengths"] for p in parts]).tolist()
        self.prompt_lengths = torch.cat([p["prompt_lengths"] for p in parts]).tolist()
        self.offsets = [0]
        for n in self.lengths:
            self.offsets.append(self.offsets[-1] + n)
        self._shards = [p["feats"] for p in parts]
        self._where = [(s, o) for s, p in enumerate(parts)  # sequence -> (its shard, its first row there)
                       for o in itertools.accumulate([0] + p["lengths"].tolist()[:-1])]
        self.feature_width, self.feature_dtype = self._shards[0].shape[1], self._shards[0].dtype
        # where each sequence's labels end: its length, or where the answer starts repeating itself
        self.ends = list(self.lengths)
        if loop_ngram:
            for i, (n, pl, o) in enumerate(zip(self.lengths, self.prompt_lengths, self.offsets)):
                self.ends[i] = pl + loop_free_length(self.tokens[o + pl: o + n].tolist(), loop_ngram)

    def feats_of(self, i: int, n: int | None = None) -> torch.Tensor:
        """Sequence i's first n (default all) feature rows [n, F], as stored (bfloat16)."""
        s, o = self._where[i]
        return self._shards[s][o:o + (self.lengths[i] if n is None else n)]

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1]

    def columns(self, layers: list[int], hidden: int) -> torch.Tensor:
        """Indices of the feature columns holding `layers`, in that order."""
        return torch.cat([torch.arange(self.layers.index(i) * hidden, (self.layers.index(i) + 1) * hidden) for i in layers])

    def batch(self, idx: list[int], seq_len: int, rng: torch.Generator, lookahead: int = 8) -> dict:
        """Training windows that see what the head sees when it drafts: every position from 0 up to the
        window is a key, and `seq_len` consecutive anchors inside the answer are the queries.

        Per sequence, the first query anchor lo is drawn uniformly from the anchors whose first label is an
        answer token; the tokens kept run from 0 to lo + seq_len + lookahead (the deeper unrolled steps read
        the tokens after their anchor). -> {"tokens" [B, S], "feats" [B, S, F], "topk_ids"/"topk_p" [B, S, k],
        "label_mask" [B, S] (a label at position t is the target's distribution of token t + 1, kept when
        t + 1 is an answer token), "anchors" [B, Q] (absolute positions of the query anchors) and
        "anchor_mask" [B, Q] (False where a sequence has fewer than Q anchors: padding repeats its last)}."""
        B, k = len(idx), self.topk_ids.shape[1]
        spans = []
        for i in idx:
            n, pl = self.ends[i], self.prompt_lengths[i]
            first = max(0, pl - 2)                 # anchor t's step-1 label is token t + 2
            last_lo = max(first, n - 1 - seq_len)
            lo = first + int(torch.randint(0, last_lo - first + 1, (1,), generator=rng))
            spans.append((lo, min(n, lo + seq_len + lookahead)))
        S = max(hi for _, hi in spans)
        Q = max(1, min(seq_len, max(hi - 1 - lo for lo, hi in spans)))
        tok = torch.zeros(B, S, dtype=torch.long)
        fe = torch.zeros(B, S, self.feature_width, dtype=self.feature_dtype)
        ids = torch.zeros(B, S, k, dtype=torch.long)
        ps = torch.zeros(B, S, k)
        lm = torch.zeros(B, S, dtype=torch.bool)
        anchors = torch.zeros(B, Q, dtype=torch.long)
        am = torch.zeros(B, Q, dtype=torch.bool)
        for r, (i, (lo, hi)) in enumerate(zip(idx, spans)):
            n, pl, o = self.ends[i], self.prompt_lengths[i], self.offsets[i]
            sl = slice(o, o + hi)
            tok[r, :hi], fe[r, :hi], ids[r, :hi], ps[r, :hi] = self.tokens[sl], self.feats_of(i, hi), self.topk_ids[sl], self.topk_p[sl]
            pos = torch.arange(hi)
            lm[r, :hi] = (pos + 1 >= pl) & (pos + 1 < n)
            a = lo + torch.arange(Q)
            am[r] = a <= hi - 2
            anchors[r] = a.clamp_max(max(lo, hi - 2))
        return {"tokens": tok, "feats": fe, "topk_ids": ids, "topk_p": ps, "label_mask": lm, "anchors": anchors,
                "anchor_mask": am}
