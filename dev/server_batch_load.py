"""Continuous batching under load (issue 19): the batched server against the one-at-a-time server in
the same run, then more clients on the batched one.

  compare  for each round, a one-at-a-time server (--max-batch 1) and a batched one (--max-batch B),
           started one after the other on the same port (first, with --baseline-checkout, the server of
           a checkout from before batching, which runs one generation at a time its own way): C clients x R greedy requests x T tokens with
           prompt lookup (method ngram); aggregate tokens/s, p50/p95 latency, and their ratios. Every
           request's text from the batched server must equal the one-at-a-time server's (greedy
           outputs are batch-invariant): mismatches are counted.
  scale    one batched server: --scale clients (16, 32 by default) x R requests; errors, lost requests
           (no 200 in the end; a 429 is retried after its Retry-After and counted), the server's
           resident memory after warm-up and after each load, its mean batch size from /metrics.

Prompts: the first turns of a shipped prompt set (MT-Bench by default). The machine's load average is
recorded around each phase: on shared cores the figures move with it.

    python -m dev.server_batch_load --model smollm2-135m --dtype bfloat16 --threads 1 \\
        --baseline-checkout /path/to/checkout-before-batching --json results/xeon/server/server-batch-load.json
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import httpx

from verispec.bench.script import command_line, write_json
from benchmarks.load_test import first_turns, rss_mb, run_clients, start_server, stop_server, summarize, warm_up
from benchmarks.soak_test import cpu_name


def scrape(url: str) -> dict[str, float]:
    """The server's unlabelled metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^([a-z_]+) (\S+)$", text, re.M)}


def serve(args, max_batch: int | None, checkout: str | None = None):
    """A server of this tree with --max-batch max_batch, or (checkout) the one-at-a-time server of another
    checkout, which has no --max-batch."""
    server = argparse.Namespace(model=args.model, method="ngram", port=args.port, max_queue=args.max_queue,
                                timeout=args.timeout, threads=args.threads, dtype=args.dtype, max_batch=max_batch,
                                batch_positions=args.batch_positions if max_batch and max_batch > 1 else None,
                                checkout=checkout)
    proc, url = start_server(server)
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    warm_up(url, model)
    return proc, url, model


def load(url: str, model: str, clients: int, args, prompts: list[str], retry_429: bool = False):
    t0 = time.perf_counter()
    results = run_clients(url, model, clients, args.requests, args.max_tokens, prompts, retry_429=retry_429,
                          duration=args.duration)
    return results, summarize(results, time.perf_counter() - t0)


def compare_phase(args, prompts: list[str]) -> dict:
    rounds = []
    for r in range(args.rounds):
        out: dict = {}
        texts: dict = {}
        servers = [("max_batch_1", 1, None), (f"max_batch_{args.max_batch}", args.max_batch, None)]
        if args.baseline_checkout:
            servers.insert(0, ("baseline_checkout", None, args.baseline_checkout))
        for name, max_batch, checkout in servers:
            load_start = os.getloadavg()[0]
            proc, url, model = serve(args, max_batch, checkout)
            try:
                results, summary = load(url, model, args.clients, args, prompts)
                m = scrape(url)
            finally:
                stop_server(proc)
            texts[name] = {(e["client"], e["request"]): e.get("text") for e in results}
            summary["mean_batch_size"] = round(m["verispec_batch_sequence_steps_total"] / m["verispec_batch_steps_total"], 2) \
                if m.get("verispec_batch_steps_total") else None
            summary["batch_positions"] = m.get("verispec_batch_positions")
            summary["load_average_1min"] = [round(load_start, 2), round(os.getloadavg()[0], 2)]
            if checkout:
                summary["checkout"] = checkout
            out[name] = summary
            print(f"round {r} {name}: {summary}", flush=True)
        many = f"max_batch_{args.max_batch}"
        for base in [name for name, _, _ in servers if name != many]:
            one, b = out[base], out[many]
            out[f"vs_{base}"] = {
                "throughput_ratio": round(b["throughput_tok_s"] / one["throughput_tok_s"], 2),
                "p50_latency_ratio": round(b["latency_p50_s"] / one["latency_p50_s"], 3),
                "p95_latency_ratio": round(b["latency_p95_s"] / one["latency_p95_s"], 3),
                "outputs_compared": sum(1 for k, v in texts[base].items() if v is not None and texts[many].get(k) is not None),
                "outputs_differing": sum(1 for k, v in texts[base].items()
                                         if v is not None and texts[many].get(k) is not None and v != texts[many][k])}
        rounds.append(out)
    return {"clients": args.clients, "requests_per_client": args.requests, "max_tokens": args.max_tokens,
            "rounds": rounds}


def scale_phase(args, prompts: list[str]) -> dict:
    out: dict = {}
    proc, url, model = serve(args, args.max_batch)
    try:
        out["server_rss_mb_after_warmup"] = round(rss_mb(proc.pid), 1)
        for clients in args.scale:
            load_start = os.getloadavg()[0]
            before = scrape(url)
            results, summary = load(url, model, clients, args, prompts, retry_429=True)
            after = scrape(url)
            steps = after["verispec_batch_steps_total"] - before.get("verispec_batch_steps_total", 0)
            seqs = after["verispec_batch_sequence_steps_total"] - before.get("verispec_batch_sequence_steps_total", 0)
            summary["lost"] = clients * args.requests - summary["served"]
            summary["mean_batch_size"] = round(seqs / steps, 2) if steps else None
            summary["server_rss_mb_after"] = round(rss_mb(proc.pid), 1)
            summary["load_average_1min"] = [round(load_start, 2), round(os.getloadavg()[0], 2)]
            out[f"clients_{clients}"] = summary
            print(f"scale {clients} clients: {summary}", flush=True)
        out["server_alive_after"] = httpx.get(url + "/health", timeout=10).status_code == 200
        out["rss_growth_mb"] = round(rss_mb(proc.pid) - out["server_rss_mb_after_warmup"], 1)
        out["runners_built"] = scrape(url).get("verispec_runners_built_total")
    finally:
        stop_server(proc)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1, help="the server's torch threads (serve --threads)")
    ap.add_argument("--port", type=int, default=8766)
    ap.add_argument("--max-batch", type=int, default=8, help="the batched server's --max-batch")
    ap.add_argument("--batch-positions", default="auto", help="the batched server's --batch-positions")
    ap.add_argument("--max-queue", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--baseline-label", default=None, help="what the baseline checkout is (recorded in the report)")
    ap.add_argument("--rounds", type=int, default=2, help="compare rounds (each: one-at-a-time, then batched)")
    ap.add_argument("--baseline-checkout", default=None,
                    help="also serve this checkout's code (one at a time: a checkout before batching) first in each round")
    ap.add_argument("--scale", default="16,32", help="client counts of the scale phase ('' to skip)")
    ap.add_argument("--prompts", default="mt_bench", help="a shipped prompt set: the first turn of each question")
    ap.add_argument("--duration", type=float, default=900.0, help="stop sending new requests after this many seconds")
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()
    args.scale = [int(c) for c in args.scale.split(",") if c.strip()]
    if args.max_batch < 2:
        raise SystemExit("--max-batch must be >= 2 (it is compared with the one-at-a-time server)")
    prompts = first_turns(args.prompts)
    report: dict = {"command": command_line(), "model": args.model, "dtype": args.dtype, "threads": args.threads,
                    "method": "ngram", "prompts": args.prompts, "max_batch": args.max_batch,
                    "batch_positions": args.batch_positions, "baseline_checkout": args.baseline_checkout,
                    "baseline_label": args.baseline_label, "machine": cpu_name(), "cpus": os.cpu_count(),
                    "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
                    "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    report["compare"] = compare_phase(args, prompts)
    if args.scale:
        report["scale"] = scale_phase(args, prompts)
    report["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    if args.json_out:
        write_json(report, args.json_out)
    print(report)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
