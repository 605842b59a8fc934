"""Core speed check (issue "verispec core"): plain decoding vs transformers generate(), and n-gram
speculation vs plain decoding, side by side in one run on the embedded SmolLM2-135M.

Methods alternate prompt by prompt so machine drift hits all alike; every greedy output is compared
with plain decoding's. Usage:

    python benchmarks/core_speed.py --dtype bfloat16 --per-category 4 --max-new-tokens 96
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from verispec.api import build_engine
from verispec.models import load_model
from verispec.types import SamplingParams
from _common import options, write_json

DATA = Path(__file__).resolve().parents[1] / "verispec" / "data" / "spec_bench" / "question.jsonl"
FALLBACK = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"

CODE_EDIT = [
    "Rename the variable `total` to `running_sum` in this code and return the whole code:\n\n"
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n\n"
    "def variance(values):\n    m = mean(values)\n    total = 0\n    for v in values:\n        total += (v - m) ** 2\n    return total / len(values)\n",
    "Add type hints to this function and return the full code:\n\n"
    "def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n"
    "            out.append(a[i]); i += 1\n        else:\n            out.append(b[j]); j += 1\n    out.extend(a[i:]); out.extend(b[j:])\n    return out\n",
]


def prompts(per_category: int) -> list[tuple[str, str]]:
    path = DATA if DATA.exists() else FALLBACK
    rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    out = [("summarization", r["turns"][0]) for r in rows if r["category"] == "summarization"][:per_category]
    out += [("code_editing", p) for p in CODE_EDIT[:per_category]]
    return out


def hf_generate(target, ids, n):
    t = time.perf_counter()
    out = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=n, do_sample=False)
    dt = time.perf_counter() - t
    new = out[0, len(ids):].tolist()
    eos = target.eos_token_ids
    for j, tok in enumerate(new):
        if tok in eos:
            new = new[:j]
            break
    return new, dt


def main() -> None:
    ap = options(__doc__, dtype="bfloat16")
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--draft-length", type=int, default=6)
    ap.add_argument("--backend", default="auto", help="auto | hf | fast")
    ap.add_argument("--exact", default=None, choices=[None, "on", "off"], help="fast path exact mode (default: on for greedy)")
    ap.add_argument("--out", default=None, help="write the raw measurements as JSON here")
    args = ap.parse_args()

    target = load_model("smollm2-135m", dtype=args.dtype)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    opts = {"backend": args.backend}
    if args.exact is not None:
        opts["exact"] = args.exact == "on"
    engines = {"ar": build_engine(target, "ar", **opts),
               "ngram": build_engine(target, "ngram", draft_length=args.draft_length, **opts)}
    warm = target.encode(chat="Hello")
    for e in engines.values():
        e.generate(warm, SamplingParams(max_new_tokens=8))
    hf_generate(target, warm, 8)

    rows = []
    for cat, text in prompts(args.per_category):
        ids = target.encode(chat=text)
        row = {"category": cat, "prompt_tokens": len(ids)}
        hf_ids, row["hf_time"] = hf_generate(target, ids, args.max_new_tokens)
        for name, engine in engines.items():
            g = engine.generate(ids, params)
            row[f"{name}_time"] = g.stats.total_time
            row[f"{name}_tokens"] = len(g.token_ids)
            row[f"{name}_tau"] = g.stats.mean_accepted_length
            row[f"{name}_ids"] = g.token_ids
        row["hf_tokens"] = len(hf_ids)
        row["ar_equals_hf"] = row["ar_ids"] == hf_ids
        row["ngram_equals_ar"] = row["ngram_ids"] == row["ar_ids"]
        rows.append(row)
        print(f"{cat:14s} hf {row['hf_tokens']/row['hf_time']:6.1f} tok/s | ar {row['ar_tokens']/row['ar_time']:6.1f} | "
              f"ngram {row['ngram_tokens']/row['ngram_time']:6.1f} (tau {row['ngram_tau']:.2f}) | "
              f"ar==hf {row['ar_equals_hf']} ngram==ar {row['ngram_equals_ar']}", flush=True)

    print(f"\nsmollm2-135m {args.dtype}, backend {args.backend}, exact {args.exact or 'default'}, "
          f"{torch.get_num_threads()} threads, {args.max_new_tokens} new tokens max")
    for cat in sorted({r["category"] for r in rows}):
        sel = [r for r in rows if r["category"] == cat]
        tps = {m: sum(r[f"{m}_tokens"] for r in sel) / sum(r[f"{m}_time"] for r in sel) for m in ("hf", "ar", "ngram")}
        print(f"{cat:14s} tok/s: hf generate {tps['hf']:.1f}, ours plain {tps['ar']:.1f} ({tps['ar']/tps['hf']:.2f}x hf), "
              f"ours ngram {tps['ngram']:.1f} ({tps['ngram']/tps['ar']:.2f}x plain, tau "
              f"{statistics.mean(r['ngram_tau'] for r in sel):.2f})")
    mismatches = [r["category"] for r in rows if not r["ngram_equals_ar"]]
    print(f"greedy outputs: ngram == plain on {len(rows) - len(mismatches)}/{len(rows)}; plain == hf on "
          f"{sum(r['ar_equals_hf'] for r in rows)}/{len(rows)}")
    if args.out:
        write_json({"rows": rows}, args.out)


if __name__ == "__main__":
    main()
