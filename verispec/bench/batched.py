"""`verispec bench --batch-size B`: many users at once. The prompt set runs through a batch.Batch of size B
with continuous admission, for each batch size and method, and every greedy output is checked against
that prompt's plain batch-1 output.

How it runs:
- the reference first: plain decoding one prompt at a time through Engine.generate (the unbatched code
  path), turn by turn; its outputs are what every batched output must equal (exact mode makes the
  batched path bit-identical whatever shares the batch), and its speed is reported next to the rest;
- then, for each batch size B (ascending) and each contender (the method order rotates from B to B, so
  drift of a shared machine does not always hit the same one): every question's first turn waits in one
  queue, all there at the start; a Batch of size B admits from the queue whenever it has room (as soon
  as a sequence finishes, between steps), prefilling the newcomer alone, then steps all active
  sequences with one shared target forward. A multi-turn question's next turn joins the back of the
  queue when its previous turn finishes, continuing its own conversation with its own answer;
- plain decoding ("ar") always runs, and batch size 1 always runs for it: "ar" at B=1 is the reference
  for speedups (aggregate tokens/s of the same prompts, measured in the same run);
- the positions budget (`positions`): the most verified positions one step spends across the batch;
  each sequence drafts at most positions // B - 1 tokens ("auto": each step batch.free_positions of
  the cost curve measured on the target once, before the timed runs, at the batch's current size; the
  row reports its value at B). Plain decoding drafts nothing, so it runs
  once, without one.

Figures per (method, B): aggregate tokens/s (all new tokens over the wall time from the first admission
to the last finish, prefills included), per-sequence latency p50/p95 from admission (its prefill
included, queue wait excluded: every prompt is queued at time 0) to its last token, time per output
token p50/p95 (that latency over its new tokens), mean accepted length (tokens per target forward per
sequence), shared forwards, mean occupancy, positions per shared forward, and the 1-minute load average
before and after.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from verispec.bench.baselines import MethodSpec, VerispecContender, parse_method
from verispec.bench.environment import environment
from verispec.bench.harness import Conversation, _resolve_chat, fitting_questions
from verispec.bench.prompts import Question
from verispec.bench.summary import REFERENCE, _first_diff
from verispec.errors import InvalidParameter
from verispec.fast.quant import target_format

SCHEMA = "verispec-bench-batch/1"
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16)
AUTO = "auto"


def parse_batch_sizes(values) -> list[int]:
    """'--batch-size' values (ints, or strings holding comma lists) -> sorted distinct sizes >= 1;
    nothing given -> the default sweep 1, 2, 4, 8, 16."""
    sizes: set[int] = set()
    for v in values or ():
        parts = [v] if isinstance(v, int) and not isinstance(v, bool) else [p.strip() for p in str(v).split(",")]
        sizes.update(_positive(p, "batch size must be an integer >= 1") for p in parts if p != "")
    return sorted(sizes) if sizes else list(DEFAULT_BATCH_SIZES)


def _positive(value: int | str, rule: str) -> int:
    """An integer >= 1 from an int or its text, else InvalidParameter(rule, what was given)."""
    try:
        n = int(value) if isinstance(value, int) or str(value).strip().lstrip("+-").isdigit() else None
    except ValueError:
        n = None
    if n is None:
        raise InvalidParameter(f"{rule}, got '{value}'")
    if n < 1:
        raise InvalidParameter(f"{rule}, got {n}")
    return n


def parse_positions(value) -> str | int | None:
    """A positions budget: 'auto', 'none' (None: each sequence drafts as it would alone) or an integer >= 1."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text in ("none", "off", ""):
        return None
    if text == AUTO:
        return AUTO
    return _positive(value, "batch positions must be auto, none or an integer >= 1")


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between the two nearest ranks (numpy's default); None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _max_rss_mib() -> float | None:
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    except (ImportError, OSError):
        return None


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


RUNNER_OPTIONS = ("backend", "exact", "compile", "weights")  # the method options that choose the runner


def runner_key(spec: MethodSpec) -> tuple:
    """Contenders with equal keys can take turns on the same runners (one is timed at a time)."""
    return tuple((k, spec.options.get(k)) for k in RUNNER_OPTIONS)


@dataclass
class Contender:
    """One method at one positions setting, with its pool of engines: one per sequence slot, each with its
    own drafter. Slot i of every contender with the same runner_key shares one runner (its KV cache: a
    generation resets it), so a bench holds B runners per runner kind, not B per contender."""

    spec: MethodSpec
    setting: str | int | None  # as asked: None, "auto" or a count
    label: str
    engines: list = field(default_factory=list)
    suffix_cache: object = None  # one suffix cache for the pool (as a server's requests share one), no other's

    def pool(self, target, n: int, draft=None, runners: list | None = None) -> list:
        from verispec.drafters.suffix import SuffixCache

        runners = [] if runners is None else runners
        if self.suffix_cache is None:
            self.suffix_cache = SuffixCache()
        while len(self.engines) < n:
            i = len(self.engines)
            options = {"suffix_cache": self.suffix_cache, **self.spec.options}
            if i < len(runners):
                options["runner"] = runners[i]
            spec = MethodSpec(self.spec.method, self.spec.draft_length, options, label=self.spec.label)
            engine = VerispecContender(target, spec, draft=draft).engine
            if i >= len(runners):
                runners.append(engine.runner)
            self.engines.append(engine)
        return self.engines[:n]


def _contenders(methods, settings: list, draft_length: int) -> list[Contender]:
    specs = [parse_method(m, draft_length) if isinstance(m, str) else m for m in methods]
    if not any(s.label == REFERENCE for s in specs):
        specs.insert(0, MethodSpec("ar", draft_length=draft_length, label=REFERENCE))
    out = []
    for s in specs:
        if s.method == "ar":  # plain decoding drafts nothing: a budget changes nothing
            out.append(Contender(s, None, s.label))
            continue
        for st in settings:
            label = s.label if st is None else f"{s.label}[positions={st}]"
            out.append(Contender(s, st, label))
    labels = [c.label for c in out]
    if len(set(labels)) != len(labels):
        raise InvalidParameter(f"two contenders share a label ({', '.join(labels)}); give them label=... options")
    return out


def _record(q: Question, qi: int, ti: int, prompt_ids: list[int], token_ids: list[int], stats: dict,
            admitted: float, finished: float) -> dict:
    latency = finished - admitted
    return {"question_index": qi, "question_id": q.question_id, "category": q.category, "turn": ti,
            "prompt_tokens": len(prompt_ids), "new_tokens": len(token_ids), "admitted_s": admitted,
            "finished_s": finished, "latency_s": latency,
            "time_per_token_s": latency / len(token_ids) if token_ids else None,
            "token_ids": list(token_ids), "stats": stats}


def run_reference(target, questions: list[Question], chat: bool, max_new_tokens: int, runner=None) -> dict:
    """Plain decoding through Engine.generate, one prompt at a time, turn by turn: the outputs every
    batched run must reproduce. runner: one to reuse (None: a new one)."""
    plain = VerispecContender(target, MethodSpec("ar", options={"runner": runner} if runner is not None else {},
                                                 label=REFERENCE))
    seqs, clock = [], 0.0
    for qi, q in enumerate(questions):
        conv = Conversation(target, chat)
        for ti, turn in enumerate(q.turns):
            ids = conv.ask(turn)
            t0 = time.perf_counter()
            out, stats = plain.generate(ids, max_new_tokens)
            dt = time.perf_counter() - t0
            conv.answer(out)
            seqs.append(_record(q, qi, ti, ids, out, stats, clock, clock + dt))
            clock += dt
    tokens = sum(s["new_tokens"] for s in seqs)
    return {"label": "plain, unbatched (Engine.generate)", "sequences": seqs, "new_tokens": tokens, "wall_s": clock,
            "tokens_per_second": tokens / clock if clock > 0 else 0.0}


def run_continuous(target, engines: list, questions: list[Question], chat: bool, batch_size: int,
                   positions: int | None, max_new_tokens: int, cost: dict | None = None) -> dict:
    """Every question through one Batch of size `batch_size` with continuous admission (see the module
    docstring) -> the sequences' records and the run's wall time, shared forwards and occupancy.
    positions: a fixed budget; cost: a cost curve the batch picks each step's budget from (auto)."""
    from verispec.batch import Batch
    from verispec.types import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    batch = Batch(max_batch=batch_size, positions=positions, cost=cost)
    queue = deque((qi, 0) for qi in range(len(questions)))
    convs = {qi: Conversation(target, chat) for qi in range(len(questions))}
    free = list(engines[:batch_size])
    live: dict[int, tuple] = {}
    seqs: list[dict] = []
    steps = occupancy = 0
    t0 = time.perf_counter()

    def done(run) -> None:
        qi, ti, ids, engine, admitted = live.pop(id(run))
        gen = run.result()
        finished = time.perf_counter() - t0
        free.append(engine)
        convs[qi].answer(gen.token_ids)
        seqs.append(_record(questions[qi], qi, ti, ids, gen.token_ids, gen.stats.to_dict(), admitted, finished))
        if ti + 1 < len(questions[qi].turns):
            queue.append((qi, ti + 1))  # the follow-up is a new request: the back of the queue

    while queue or batch.active:
        while queue and not batch.full:
            qi, ti = queue.popleft()
            ids = convs[qi].ask(questions[qi].turns[ti])
            engine = free.pop()
            admitted = time.perf_counter() - t0
            run = batch.add(engine, ids, params)
            live[id(run)] = (qi, ti, ids, engine, admitted)
            if run.finished:
                done(run)
        if not batch.active:
            continue
        steps += 1
        occupancy += len(batch.active)
        for run, _ in batch.step():
            if run.finished:
                done(run)
    wall = time.perf_counter() - t0
    seqs.sort(key=lambda s: (s["question_index"], s["turn"]))
    return {"sequences": seqs, "wall_s": wall, "batch_steps": steps, "occupancy_sum": occupancy}


def summarize_run(run: dict) -> dict:
    """A run's figures (see the module docstring); `speedup` and `matches_plain` are filled in later."""
    seqs = run["sequences"]
    tokens = sum(s["new_tokens"] for s in seqs)
    stats = [s["stats"] for s in seqs if s["stats"]]
    total = {k: sum(st.get(k, 0) or 0 for st in stats) for k in ("steps", "drafted", "accepted", "committed", "nodes_verified")}
    lat = [s["latency_s"] for s in seqs]
    tpot = [s["time_per_token_s"] for s in seqs if s["time_per_token_s"] is not None]
    steps = run.get("batch_steps") or 0
    return {
        "sequences": len(seqs), "new_tokens": tokens, "wall_s": run["wall_s"],
        "tokens_per_second": tokens / run["wall_s"] if run["wall_s"] > 0 else 0.0,
        "latency_p50_s": percentile(lat, 50), "latency_p95_s": percentile(lat, 95),
        "time_per_token_p50_s": percentile(tpot, 50), "time_per_token_p95_s": percentile(tpot, 95),
        "mean_accepted_length": total["committed"] / total["steps"] if total["steps"] else 0.0,
        "acceptance_rate": total["accepted"] / total["drafted"] if total["drafted"] else None,
        "mean_draft_length": total["drafted"] / total["steps"] if total["steps"] else 0.0,
        "batch_steps": steps,
        "mean_occupancy": run["occupancy_sum"] / steps if steps else None,
        # each sequence's step verifies its pending token and its drafted nodes
        "positions_per_step": (total["steps"] + total["nodes_verified"]) / steps if steps else None,
    }


def find_batch_mismatches(reference: dict, entries: list[dict]) -> list[dict]:
    """Every (contender, batch size, question) whose greedy output differs from plain batch-1 decoding's,
    at its first differing turn (later turns continue a different conversation)."""
    ref = {(s["question_index"], s["turn"]): s["token_ids"] for s in reference["sequences"]}
    found = []
    for e in entries:
        bad_q = set()
        for s in sorted(e["sequences"], key=lambda s: (s["question_index"], s["turn"])):
            if s["question_index"] in bad_q:
                continue
            plain = ref[(s["question_index"], s["turn"])]
            d = _first_diff(s["token_ids"], plain)
            if d is not None:
                bad_q.add(s["question_index"])
                found.append({"method": e["label"], "kind": "verispec", "batch_size": e["batch_size"],
                              "positions": e["positions"], "question_index": s["question_index"],
                              "question_id": s["question_id"], "category": s["category"], "turn": s["turn"],
                              "first_difference_at": d, "plain_tokens": len(plain), "method_tokens": len(s["token_ids"])})
    return found


def _fill_comparisons(result: dict) -> None:
    base = next((e for e in result["entries"] if e["label"] == REFERENCE and e["batch_size"] == 1), None)
    ref_tps = base["summary"]["tokens_per_second"] if base else 0.0
    bad = {}
    for m in result["mismatches"]:
        key = (m["method"], m["batch_size"])
        bad[key] = bad.get(key, 0) + 1
    for e in result["entries"]:
        s = e["summary"]
        s["speedup"] = s["tokens_per_second"] / ref_tps if ref_tps > 0 else None
        s["questions"] = len({q["question_index"] for q in e["sequences"]})
        s["matches_plain"] = s["questions"] - bad.get((e["label"], e["batch_size"]), 0)


def run_batch_bench(target, methods=("ar", "ngram"), questions: list[Question] | None = None, *,
                    batch_sizes=DEFAULT_BATCH_SIZES, positions=(None,), draft=None, max_new_tokens: int = 64,
                    draft_length: int = 5, warmup: int = 1, prompt_mode: str = "auto", progress: bool = True,
                    threads: int | None = None, prompt_set: str = "") -> dict:
    """Run the batched benchmark and return the full result (JSON-ready): config, environment, the
    plain batch-1 reference, one entry per (contender, batch size) with its sequences and summary, the
    greedy mismatches.

    methods: names, specs like 'ngram:draft_length=4', or MethodSpec objects ("ar" is always added).
    batch_sizes: sizes >= 1 (B=1 is added for "ar", the speedup reference). positions: the budgets to run
    each drafting method with (None, "auto" or an int; see the module docstring)."""
    from verispec.batch import free_positions
    from verispec.models import LoadedModel, load_model

    if not questions:
        raise InvalidParameter("no questions to run")
    if max_new_tokens < 1:
        raise InvalidParameter(f"max new tokens must be >= 1, got {max_new_tokens}")
    sizes = parse_batch_sizes(batch_sizes)
    settings = list(dict.fromkeys(parse_positions(p) for p in (positions or (None,))))
    if threads is not None:
        if threads < 1:
            raise InvalidParameter(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    if isinstance(target, str):
        target = load_model(target)
    if draft is not None and not isinstance(draft, LoadedModel):
        draft = load_model(draft, dtype=target.dtype, device=target.device)
    chat = _resolve_chat(target, prompt_mode)
    contenders = _contenders(methods, settings, draft_length)

    runnable, skipped_q = fitting_questions(target, chat, questions, max_new_tokens)

    from verispec.tree import DynamicTree, measure_verify_cost

    top = max(sizes)
    runners: dict[tuple, list] = {}
    for c in contenders:  # every engine built (and its drafter checked) before anything is timed
        c.pool(target, top, draft, runners.setdefault(runner_key(c.spec), []))
    cost, resolved = None, {}
    if AUTO in settings:
        cost = measure_verify_cost(contenders[0].engines[0].runner)
        resolved[AUTO] = free_positions(cost)
    for c in contenders:  # a dynamic tree sizes itself from the cost curve: measured once here, not per engine in a timed run
        for e in c.engines:
            if isinstance(e.tree, DynamicTree) and e.tree.budget is None and e.budget.verify_cost is None:
                cost = cost or measure_verify_cost(contenders[0].engines[0].runner)
                e.budget.verify_cost = cost
    for st in settings:
        if isinstance(st, int):
            resolved[st] = st
    fixed = lambda st: None if st == AUTO else resolved.get(st)  # noqa: E731
    priced = lambda st: cost if st == AUTO else None  # noqa: E731 - auto: the budget follows the batch's size

    warm = runnable[:min(top, 4)]
    for c in contenders:  # untimed: a short batched run over a few prompts warms kernels and drafters
        for _ in range(warmup):
            run_continuous(target, c.engines, [Question(q.question_id, q.category, q.turns[:1]) for q in warm], chat,
                           min(top, len(warm)), fixed(c.setting), min(max_new_tokens, 8), cost=priced(c.setting))
    for c in contenders:  # the warm-up answered measured questions: no drafter may remember them
        for e in c.engines:
            e.forget()

    from tqdm.auto import tqdm

    plan = [(b, c) for i, b in enumerate(sizes) for c in (contenders[i % len(contenders):] + contenders[:i % len(contenders)])]
    if 1 not in sizes:
        plan.insert(0, (1, contenders[0]))
    bar = tqdm(total=len(plan) + 1, disable=not progress, unit="run", desc="bench --batch-size", file=sys.stderr)
    bar.set_postfix_str("plain reference")
    load0 = _load()
    reference = run_reference(target, runnable, chat, max_new_tokens, runner=contenders[0].engines[0].runner)
    reference["load_average"] = [load0, _load()]
    bar.update(1)
    entries = []
    for b, c in plan:
        bar.set_postfix_str(f"{c.label} B={b}")
        load0 = _load()
        run = run_continuous(target, c.engines, runnable, chat, b, fixed(c.setting), max_new_tokens, cost=priced(c.setting))
        budget = free_positions(cost, rows=b) if c.setting == AUTO else resolved.get(c.setting)
        entry = {"label": c.label, "method": c.spec.method, "batch_size": b,
                 "positions_setting": c.setting, "positions": budget,
                 "load_average": [load0, _load()], **run}
        entry["summary"] = summarize_run(run)
        entry["summary"]["draft_cap"] = (max(0, entry["positions"] // b - 1) if entry["positions"] else None)
        entries.append(entry)
        bar.update(1)
    bar.close()
    entries.sort(key=lambda e: ([c.label for c in contenders].index(e["label"]), e["batch_size"]))

    result = {
        "schema": SCHEMA,
        "config": {
            "model": target.name, "dtype": str(target.dtype).replace("torch.", ""), "device": str(target.device),
            "weights": target_format(target), "draft": draft.name if draft is not None else None, "prompt_set": prompt_set,
            "prompt_mode": "chat" if chat else "raw", "max_new_tokens": max_new_tokens, "draft_length": draft_length,
            "warmup": warmup, "greedy": True, "batch_sizes": sizes, "admission": "continuous",
            "positions": [AUTO if s == AUTO else s for s in settings], "positions_resolved": resolved.get(AUTO),
            "contenders": [{"label": c.label, "method": c.spec.method, "draft_length": c.spec.draft_length,
                            "options": c.spec.options, "positions": c.setting} for c in contenders],
            "skipped_questions": skipped_q,
        },
        "environment": environment(target),
        "questions": [q.to_dict() for q in runnable],
        "reference": reference,
        "entries": entries,
    }
    result["environment"]["load_average_1_5_15"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    result["memory"] = {"max_rss_mib": _max_rss_mib(), "engines": sum(len(c.engines) for c in contenders),
                        "runners": sum(len(r) for r in runners.values())}
    if cost is not None:
        result["cost_curve"] = {"ns": list(cost), "times_s": list(cost.values())}
    result["mismatches"] = find_batch_mismatches(reference, entries)
    _fill_comparisons(result)
    return result
