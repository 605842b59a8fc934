"""A bench run's figures: greedy mismatches against plain decoding, and per-contender summaries (overall and
per category) with speedups over plain decoding in the same run and theory's predicted speedups."""

from __future__ import annotations

from verispec.theory import CostCurve

REFERENCE = "ar"  # plain decoding: the reference for speedups and for greedy exactness


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def find_mismatches(runs: list[dict]) -> list[dict]:
    """Every (question, contender, turn) whose greedy output differs from plain decoding's."""
    ref = {r["question_index"]: r for r in runs if r["method"] == REFERENCE}
    found = []
    for r in runs:
        base = ref.get(r["question_index"])
        if r["method"] == REFERENCE or base is None:
            continue
        for ti, (t, bt) in enumerate(zip(r["turns"], base["turns"])):
            d = _first_diff(t["token_ids"], bt["token_ids"])
            if d is not None:
                found.append({"question_index": r["question_index"], "question_id": r["question_id"], "category": r["category"], "method": r["method"],
                              "kind": r["kind"], "turn": ti, "first_difference_at": d,
                              "plain_tokens": len(bt["token_ids"]), "method_tokens": len(t["token_ids"])})
                break  # later turns continue a different conversation
    return found


_SUMMED = ("steps", "drafted", "accepted", "committed", "draft_time", "verify_time", "prefill_time")


def _aggregate(runs: list[dict]) -> dict:
    tokens = sum(r["new_tokens"] for r in runs)
    secs = sum(r["time_s"] for r in runs)
    agg = {"questions": len(runs), "new_tokens": tokens, "time_s": secs,
           "tokens_per_second": tokens / secs if secs > 0 else 0.0}
    stats = [t["stats"] for r in runs for t in r["turns"] if t["stats"]]
    if stats:
        s = {k: sum(st.get(k, 0) or 0 for st in stats) for k in _SUMMED}
        width = max((len(st.get("drafted_by_position", [])) for st in stats), default=0)
        dpos, apos = [0] * width, [0] * width
        for st in stats:
            for i, v in enumerate(st.get("drafted_by_position", [])):
                dpos[i] += v
            for i, v in enumerate(st.get("accepted_by_position", [])):
                apos[i] += v
        loop = s["draft_time"] + s["verify_time"]
        decode = secs - s["prefill_time"]  # the generations' time after their prompts were in the cache
        agg.update(
            decode_time_s=decode, decode_tokens_per_second=tokens / decode if decode > 0 else 0.0,
            steps=s["steps"], drafted=s["drafted"], accepted=s["accepted"], committed=s["committed"],
            mean_accepted_length=s["committed"] / s["steps"] if s["steps"] else 0.0,
            acceptance_rate=s["accepted"] / s["drafted"] if s["drafted"] else None,
            mean_draft_length=s["drafted"] / s["steps"] if s["steps"] else 0.0,
            acceptance_by_position=[a / d if d else 0.0 for a, d in zip(apos, dpos)],
            draft_time_s=s["draft_time"], verify_time_s=s["verify_time"], prefill_time_s=s["prefill_time"],
            draft_share=s["draft_time"] / loop if loop > 0 else 0.0,
            verify_share=s["verify_time"] / loop if loop > 0 else 0.0,
        )
    return agg


def _predict(agg: dict, ref: dict, curve: CostCurve | None) -> None:
    """Theory's speedup from this run's own rates: tau / (k c + verification cost), with c the measured draft
    time per drafted token in plain-decoding forwards (Leviathan et al. 2023, Sec. 3.4)."""
    if not agg.get("steps") or not ref.get("steps") or not ref.get("verify_time_s"):
        return
    t_forward = ref["verify_time_s"] / ref["steps"]  # one plain decoding step = one 1-position forward
    k = agg["mean_draft_length"]
    c = (agg["draft_time_s"] / agg["drafted"]) / t_forward if agg["drafted"] else 0.0
    tau = agg["mean_accepted_length"]
    agg["draft_cost_ratio"] = c
    agg["verify_cost_ratio"] = (agg["verify_time_s"] / agg["steps"]) / t_forward
    agg["predicted_speedup_flat"] = tau / (k * c + 1.0)
    if curve is not None:
        agg["predicted_speedup_curve"] = tau / (k * c + curve.ratio(k + 1))


def summarize(runs: list[dict], curve: CostCurve | None = None) -> dict:
    """Per contender: per category and overall figures; speedups against plain decoding on the same
    questions (tokens per second over the group, Spec-Bench's ratio of speeds)."""
    cats = list(dict.fromkeys(r["category"] for r in runs))
    labels = list(dict.fromkeys(r["method"] for r in runs))
    bad = {(m["question_index"], m["method"]) for m in find_mismatches(runs)}
    out = {}
    for label in labels:
        mine = [r for r in runs if r["method"] == label]
        entry = {"kind": mine[0]["kind"], "categories": {}}
        groups = [(cat, [r for r in mine if r["category"] == cat]) for cat in cats] + [("overall", mine)]
        for name, group in groups:
            if not group:
                continue
            qids = {r["question_index"] for r in group}
            ref_group = [r for r in runs if r["method"] == REFERENCE and r["question_index"] in qids]
            agg = _aggregate(group)
            ref = _aggregate(ref_group) if ref_group else {}
            agg["speedup"] = agg["tokens_per_second"] / ref["tokens_per_second"] if ref.get("tokens_per_second") else None
            # prefill is the same work for every method and speculation cannot shorten it: the speedup of the
            # decoding alone is what Spec-Bench's long generations measure, where prefill is a small share
            agg["decode_speedup"] = (agg["decode_tokens_per_second"] / ref["decode_tokens_per_second"]
                                     if agg.get("decode_tokens_per_second") and ref.get("decode_tokens_per_second") else None)
            agg["matches_plain"] = sum((r["question_index"], label) not in bad for r in group)
            _predict(agg, ref, curve)
            if name == "overall":
                entry["overall"] = agg
            else:
                entry["categories"][name] = agg
        out[label] = entry
    return out
