"""Load test for `verispec serve`: N concurrent clients on loopback, bounded by request count and time.

Starts the server itself (so it knows its process and can read its memory), or targets --url. Each
client sends chat completions one after another; the report gives requests served, errors by status,
p50/p95 latency, throughput, and the server's resident memory before and after.

    python benchmarks/load_test.py --model smollm2-135m --clients 8 --requests 2 --max-tokens 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import httpx
from _common import write_json

PROMPTS = [
    "Write a Python function that reverses a list.",
    "What is the capital of France? Answer in one sentence.",
    "List three uses of a hash table.",
    "Explain what a binary search does.",
    "Write a haiku about the sea.",
    "What does HTTP stand for?",
    "Give two tips for writing clear code.",
    "Summarize the water cycle in two sentences.",
]


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q * (len(ordered) - 1))))
    return ordered[k]


def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-c", "from verispec.cli import app; app()", "serve", "--model", args.model, "--method", args.method,
           "--port", str(args.port), "--log-level", "warning", "--max-queue", str(args.max_queue), "--timeout", str(args.timeout)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{args.port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {proc.stderr.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("the server did not come up in 300 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="an already running server (default: start one)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="ngram", help="server default method (when starting one)")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--max-queue", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the server (serve --threads)")
    ap.add_argument("--timeout", type=float, default=300.0, help="the server's per-request timeout (serve --timeout)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--duration", type=float, default=300.0, help="stop sending new requests after this many seconds")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--json", dest="json_out", help="also write the report as JSON here")
    args = ap.parse_args()

    proc = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        proc, url = start_server(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        model = httpx.get(url + "/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
        # one warm-up request so the first timed request does not pay for lazy initialisation
        httpx.post(url + "/v1/chat/completions", headers=headers, timeout=120,
                   json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        mem_before = rss_mb(proc.pid) if proc else None
        results: list[dict] = []
        lock = threading.Lock()
        stop_at = time.monotonic() + args.duration

        def client(i: int) -> None:
            with httpx.Client(timeout=600, headers=headers) as http:
                for r in range(args.requests):
                    if time.monotonic() > stop_at:
                        return
                    body = {"model": model, "max_tokens": args.max_tokens, "temperature": 0,
                            "messages": [{"role": "user", "content": PROMPTS[(i + r) % len(PROMPTS)]}]}
                    t0 = time.perf_counter()
                    try:
                        resp = http.post(url + "/v1/chat/completions", json=body)
                        status, data = resp.status_code, resp.json()
                    except (httpx.HTTPError, json.JSONDecodeError) as exc:
                        status, data = f"{type(exc).__name__}", {}
                    entry = {"client": i, "status": status, "latency": time.perf_counter() - t0}
                    if status == 200:
                        entry["tokens"] = data["usage"]["completion_tokens"]
                        entry["queue_time"] = data["verispec"].get("queue_time", 0.0)
                        entry["tau"] = data["verispec"]["mean_accepted_length"]
                    with lock:
                        results.append(entry)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        mem_after = rss_mb(proc.pid) if proc else None
        ok = [r for r in results if r["status"] == 200]
        errors: dict[str, int] = {}
        for r in results:
            if r["status"] != 200:
                errors[str(r["status"])] = errors.get(str(r["status"]), 0) + 1
        lat = [r["latency"] for r in ok]
        report = {
            "url": url, "model": model, "clients": args.clients, "requests_per_client": args.requests,
            "max_tokens": args.max_tokens, "sent": len(results), "served": len(ok), "errors": errors,
            "latency_p50_s": round(percentile(lat, 0.50), 3), "latency_p95_s": round(percentile(lat, 0.95), 3),
            "latency_max_s": round(max(lat), 3) if lat else None,
            "queue_wait_mean_s": round(statistics.mean(r["queue_time"] for r in ok), 3) if ok else None,
            "mean_accepted_length": round(statistics.mean(r["tau"] for r in ok), 3) if ok else None,
            "tokens": sum(r["tokens"] for r in ok), "wall_s": round(wall, 2),
            "throughput_tok_s": round(sum(r["tokens"] for r in ok) / wall, 2) if wall else None,
            "server_rss_mb_before": round(mem_before, 1) if mem_before else None,
            "server_rss_mb_after": round(mem_after, 1) if mem_after else None,
            "server_alive_after": httpx.get(url + "/health", timeout=10).status_code == 200,
        }
        print(json.dumps(report, indent=2))
        if args.json_out:
            write_json(report, args.json_out)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
