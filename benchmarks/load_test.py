"""Load test for `verispec serve`: N concurrent clients on loopback, bounded by request count and time.

Starts the server itself (so it knows its process and can read its memory), or targets --url. Each
client sends chat completions one after another; the report gives requests served, errors by status,
p50/p95 latency, throughput, and the server's resident memory before and after.

    python -m benchmarks.load_test --model smollm2-135m --clients 8 --requests 2 --max-tokens 16
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
from verispec.bench.script import write_json

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
    for flag, name in (("--dtype", "dtype"), ("--max-batch", "max_batch"), ("--batch-positions", "batch_positions")):
        if getattr(args, name, None) is not None:  # else the server's default
            cmd += [flag, str(getattr(args, name))]
    env = None
    if getattr(args, "checkout", None):  # serve the code of another checkout (a before/after comparison)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [args.checkout, os.environ.get("PYTHONPATH")]))}
    # python -c puts the working directory first on sys.path: run a checkout's server from inside it
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=getattr(args, "checkout", None) or None)
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


def run_clients(url: str, model: str, clients: int, requests: int, max_tokens: int, prompts: list[str],
                headers: dict | None = None, duration: float = 300.0, retry_429: bool = False) -> list[dict]:
    """`clients` threads, each sending `requests` greedy chat completions one after another (client i's
    r-th request asks prompts[(i * requests + r) % len(prompts)]) -> one entry per request: status (the
    last one), latency from its first try, tokens, the server's queue_time and tau, 429 retries.
    retry_429: a 429 is retried after its Retry-After (a well-behaved client), counted in "retries"."""
    results: list[dict] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + duration

    def client(i: int) -> None:
        with httpx.Client(timeout=600, headers=headers or {}) as http:
            for r in range(requests):
                if time.monotonic() > stop_at:
                    return
                body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                        "messages": [{"role": "user", "content": prompts[(i * requests + r) % len(prompts)]}]}
                t0 = time.perf_counter()
                retries = 0
                while True:
                    try:
                        resp = http.post(url + "/v1/chat/completions", json=body)
                        status, data = resp.status_code, resp.json()
                    except (httpx.HTTPError, json.JSONDecodeError) as exc:
                        status, data = f"{type(exc).__name__}", {}
                    if status == 429 and retry_429 and time.monotonic() < stop_at:
                        retries += 1
                        time.sleep(float(resp.headers.get("Retry-After", "1")))
                        continue
                    break
                entry = {"client": i, "request": r, "status": status, "latency": time.perf_counter() - t0,
                         "retries": retries}
                if status == 200:
                    entry["tokens"] = data["usage"]["completion_tokens"]
                    entry["queue_time"] = data["verispec"].get("queue_time", 0.0)
                    entry["tau"] = data["verispec"]["mean_accepted_length"]
                    entry["text"] = data["choices"][0]["message"]["content"]
                with lock:
                    results.append(entry)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def summarize(results: list[dict], wall: float) -> dict:
    """Requests served, errors by status, latency percentiles, throughput of a run_clients result."""
    ok = [r for r in results if r["status"] == 200]
    errors: dict[str, int] = {}
    for r in results:
        if r["status"] != 200:
            errors[str(r["status"])] = errors.get(str(r["status"]), 0) + 1
    lat = [r["latency"] for r in ok]
    return {
        "sent": len(results), "served": len(ok), "errors": errors,
        "retries_429": sum(r.get("retries", 0) for r in results),
        "latency_p50_s": round(percentile(lat, 0.50), 3), "latency_p95_s": round(percentile(lat, 0.95), 3),
        "latency_max_s": round(max(lat), 3) if lat else None,
        "queue_wait_mean_s": round(statistics.mean(r["queue_time"] for r in ok), 3) if ok else None,
        "mean_accepted_length": round(statistics.mean(r["tau"] for r in ok), 3) if ok else None,
        "tokens": sum(r["tokens"] for r in ok), "wall_s": round(wall, 2),
        "throughput_tok_s": round(sum(r["tokens"] for r in ok) / wall, 2) if wall else None,
    }


def warm_up(url: str, model: str, headers: dict | None = None) -> None:
    """One short request, so the first timed one does not pay for lazy initialisation (and the batch's
    positions budget is measured)."""
    httpx.post(url + "/v1/chat/completions", headers=headers or {}, timeout=300,
               json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="an already running server (default: start one)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="ngram", help="server default method (when starting one)")
    ap.add_argument("--dtype", default=None, help="the server's --dtype (default: the server's)")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--max-queue", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=None, help="the server's --max-batch (default: the server's)")
    ap.add_argument("--batch-positions", default=None, help="the server's --batch-positions")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the server (serve --threads)")
    ap.add_argument("--timeout", type=float, default=300.0, help="the server's per-request timeout (serve --timeout)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prompts", default=None, help="a shipped prompt set (mt_bench, spec_bench, ...): the first turn "
                                                    "of each question (default: a few built-in prompts)")
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
    prompts = PROMPTS if args.prompts is None else first_turns(args.prompts)
    try:
        model = httpx.get(url + "/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
        warm_up(url, model, headers)
        mem_before = rss_mb(proc.pid) if proc else None
        t0 = time.perf_counter()
        results = run_clients(url, model, args.clients, args.requests, args.max_tokens, prompts, headers, args.duration)
        wall = time.perf_counter() - t0
        mem_after = rss_mb(proc.pid) if proc else None
        report = {"url": url, "model": model, "clients": args.clients, "requests_per_client": args.requests,
                  "max_tokens": args.max_tokens, **summarize(results, wall),
                  "server_rss_mb_before": round(mem_before, 1) if mem_before else None,
                  "server_rss_mb_after": round(mem_after, 1) if mem_after else None,
                  "server_alive_after": httpx.get(url + "/health", timeout=10).status_code == 200}
        print(json.dumps(report, indent=2))
        if args.json_out:
            write_json(report, args.json_out)
    finally:
        if proc is not None:
            stop_server(proc)


def first_turns(name: str) -> list[str]:
    """The first user turn of every question of a prompt set (verispec.bench.prompts)."""
    from verispec.bench.prompts import load_prompts

    return [q.turns[0] for q in load_prompts(name)]


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
