"""A Spec-Bench style harness: methods x prompts, greedy, batch 1, timed from prompt to last token.

How it runs (after Spec-Bench, Xia et al. 2024, and its evaluation scripts):
- every contender (verispec methods and baselines) is warmed up first, untimed;
- questions are taken one at a time and EVERY contender answers it before the next question, in an order
  that rotates from question to question, so drift of a shared, noisy machine hits all of them alike;
- a multi-turn question is answered turn by turn, each contender continuing its own conversation with
  its own earlier answer; a question's time is the sum of its turns' generate() times;
- a contender that keeps a memory across generations (suffix decoding's cache of earlier outputs) keeps it
  across the questions of the run, in question order, but forgets the warm-up (which answered a measured
  question); each contender's cache is its own (suffix_cache=private unless a method spec says otherwise),
  or two suffix contenders (suffix, suffix+eagle, ...) would read each other's answers to the same question;
- plain decoding ("ar") always runs: it is the reference for speedups and for greedy exactness. Any
  verispec output that differs from it is a bug in a lossless method and is reported loudly.
"""

from __future__ import annotations

import sys
import time

import torch

from verispec.bench.baselines import MethodSpec, VerispecContender, make_baseline, parse_method
from verispec.bench.environment import environment
from verispec.bench.prompts import Question
from verispec.bench.summary import REFERENCE, find_mismatches, summarize
from verispec.errors import InvalidParameter
from verispec.fast.quant import target_format
from verispec.theory import CostCurve

SCHEMA = "verispec-bench/1"


class Conversation:
    """One contender's conversation on one question: chat template messages, or raw token concatenation
    (for tokenizers without a chat template)."""

    def __init__(self, target, chat: bool):
        self.target, self.chat = target, chat
        self.messages: list[dict] = []
        self.ids: list[int] = []

    def ask(self, turn: str) -> list[int]:
        if self.chat:
            self.messages.append({"role": "user", "content": turn})
            return self.target.encode(chat=self.messages)
        self.ids = self.ids + self.target.encode(prompt=turn)
        return list(self.ids)

    def answer(self, token_ids: list[int]) -> None:
        if self.chat:
            self.messages.append({"role": "assistant", "content": self.target.decode(token_ids)})
        else:
            self.ids = self.ids + list(token_ids)


def fitting_questions(target, chat: bool, questions: list, max_new_tokens: int) -> tuple[list, list[dict]]:
    """(the questions whose turns and answers fit the context window, the skipped ones with why): a question
    that does not fit is skipped for every contender alike. Later turns are estimated by their raw length
    (the chat template adds a few tokens)."""
    runnable, skipped = [], []
    for q in questions:
        n = len(Conversation(target, chat).ask(q.turns[0])) + max_new_tokens * len(q.turns) + sum(
            len(target.encode(prompt=t)) + 8 for t in q.turns[1:])
        if n >= target.context_length:
            skipped.append({"question_id": q.question_id, "reason": f"needs ~{n} positions > {target.context_length}"})
        else:
            runnable.append(q)
    if not runnable:
        raise InvalidParameter("no question fits the model's context window with these settings")
    return runnable, skipped


def _resolve_chat(target, mode: str) -> bool:
    has_template = bool(getattr(target.tokenizer, "chat_template", None))
    if mode == "auto":
        return has_template
    if mode == "chat":
        if not has_template:
            raise InvalidParameter(f"{target.name}'s tokenizer has no chat template; use raw prompts (--prompt-mode raw)")
        return True
    if mode == "raw":
        return False
    raise InvalidParameter(f"prompt mode must be auto, chat or raw, got '{mode}'")


def _contenders(target, methods, draft, baselines, draft_length, threads):
    """Build contenders; the plain-decoding reference comes first."""
    built, skipped = [], {}
    specs = []
    for m in methods:
        if isinstance(m, str):
            m = parse_method(m, draft_length)
        specs.append(m)
    if not any(isinstance(s, MethodSpec) and s.label == REFERENCE for s in specs):
        specs.insert(0, MethodSpec("ar", draft_length=draft_length, label=REFERENCE))
    for s in specs:
        c = VerispecContender(target, s, draft=draft) if isinstance(s, MethodSpec) else s
        built.append(c)
    for name in baselines:
        c, why = make_baseline(name, target, draft=draft, draft_length=draft_length, threads=threads)
        if c is None:
            skipped[name] = why
        else:
            built.append(c)
    labels = [c.label for c in built]
    if len(set(labels)) != len(labels):
        raise InvalidParameter(f"two contenders share a label ({', '.join(labels)}); give them label=... options")
    return built, skipped


def run_bench(target, methods=("ar", "ngram"), questions: list[Question] | None = None, *, draft=None,
              baselines=(), max_new_tokens: int = 64, draft_length: int = 5, warmup: int = 1,
              prompt_mode: str = "auto", roofline=None, progress: bool = True, threads: int | None = None,
              dtype: str = "float32", device: str | None = "cpu", prompt_set: str = "") -> dict:
    """Run the benchmark and return the full result (JSON-ready): config, environment, every run, summary.

    target: a LoadedModel or a model name (loaded with dtype/device). methods: method names, specs like
    'ngram:draft_length=4', MethodSpec objects, or ready contenders (baselines.Contender).
    draft: the draft model (LoadedModel or name) for 'draft' and 'hf-assisted'. roofline: a roofline
    result or file for the predicted speedup with the measured verification cost."""
    from verispec.models import LoadedModel, load_model

    if not questions:
        raise InvalidParameter("no questions to run")
    if max_new_tokens < 1:
        raise InvalidParameter(f"max new tokens must be >= 1, got {max_new_tokens}")
    if threads is not None:
        if threads < 1:
            raise InvalidParameter(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    if isinstance(target, str):
        target = load_model(target, dtype=dtype, device=device)
    if draft is not None and not isinstance(draft, LoadedModel):
        draft = load_model(draft, dtype=target.dtype, device=target.device)
    curve = None
    if roofline is not None:
        curve = roofline if isinstance(roofline, CostCurve) else CostCurve.from_roofline(roofline)
    chat = _resolve_chat(target, prompt_mode)
    contenders, skipped = _contenders(target, methods, draft, baselines, draft_length, threads)

    runnable, skipped_q = fitting_questions(target, chat, questions, max_new_tokens)

    def drop(c, exc: Exception) -> None:
        """A foreign baseline that raises is reported as not run (with why), and the bench goes on;
        a verispec method that raises is a bug and stops it."""
        if c.kind != "baseline":
            raise exc
        skipped[c.label] = f"failed: {type(exc).__name__}: {str(exc)[:160]}"
        contenders.remove(c)

    warm_ids = Conversation(target, chat).ask(runnable[0].turns[0])
    for c in list(contenders):
        try:
            for _ in range(warmup):
                c.generate(warm_ids, min(max_new_tokens, 16))
        except Exception as exc:  # noqa: BLE001 - see drop()
            drop(c, exc)
    for c in contenders:  # the warm-up answered a measured question: no contender may remember it
        c.forget()

    from tqdm.auto import tqdm

    runs = []
    bar = tqdm(total=len(runnable) * len(contenders), disable=not progress, unit="run", desc="bench", file=sys.stderr)
    for qi, q in enumerate(runnable):
        shift = qi % len(contenders)
        for c in contenders[shift:] + contenders[:shift]:
            bar.set_postfix_str(f"{q.category} #{q.question_id} {c.label}")
            conv = Conversation(target, chat)
            turns = []
            try:
                for turn in q.turns:
                    ids = conv.ask(turn)
                    t0 = time.perf_counter()
                    out, stats = c.generate(ids, max_new_tokens)
                    elapsed = time.perf_counter() - t0
                    conv.answer(out)
                    turns.append({"prompt_tokens": len(ids), "new_tokens": len(out), "time_s": elapsed,
                                  "token_ids": out, "stats": stats})
            except Exception as exc:  # noqa: BLE001 - see drop(): its earlier runs go too
                drop(c, exc)
                runs = [r for r in runs if r["method"] != c.label]
                continue
            runs.append({"question_id": q.question_id, "category": q.category, "method": c.label,
                         "kind": c.kind, "question_index": qi,
                         "new_tokens": sum(t["new_tokens"] for t in turns),
                         "time_s": sum(t["time_s"] for t in turns), "turns": turns})
            bar.update(1)
    bar.close()

    result = {
        "schema": SCHEMA,
        "config": {
            "model": target.name, "dtype": str(target.dtype).replace("torch.", ""), "device": str(target.device),
            "weights": target_format(target),
            "draft": draft.name if draft is not None else None, "prompt_set": prompt_set, "prompt_mode": "chat" if chat else "raw",
            "max_new_tokens": max_new_tokens, "draft_length": draft_length, "warmup": warmup,
            "greedy": True, "batch_size": 1,
            "contenders": [{"label": c.label, "kind": c.kind, **c.describe()} for c in contenders],
            "skipped_contenders": skipped, "skipped_questions": skipped_q,
            "roofline": curve.source if curve is not None else None,
        },
        "environment": environment(target),
        "questions": [q.to_dict() for q in runnable],
        "runs": runs,
    }
    if curve is not None:
        result["cost_curve"] = {"ns": curve.ns, "times_s": curve.times}
    result["mismatches"] = find_mismatches(runs)
    result["summary"] = summarize(runs, curve)
    return result
