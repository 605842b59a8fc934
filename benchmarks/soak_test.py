"""Soak and load figures for `verispec serve` (issue 22): memory over many requests, nothing lost under
concurrency, a long prompt stopped by its timeout, and the memory a runner costs.

Phases (all by default; --phases picks some):
  runners  in this process: RSS after loading the model, after the first runner (the shared fast
           weights + a KV cache) and after each further runner of the same model (a KV cache only)
  soak     N sequential short requests on one keep-alive connection (max_tokens 1-2, methods ar/ngram
           alternating, every 10th one a bad request that must get a 4xx); the server's RSS every 100
  load     C concurrent clients x R requests; a 429 is retried after its Retry-After; lost = a request
           that never got a 200
  long     one prompt of --long-tokens tokens with "verispec": {"timeout": 1}: seconds to the 504, and
           the next request served

The server is started here (`verispec serve`, loopback) so its memory can be read from /proc.

    python -m benchmarks.soak_test --model smollm2-135m --soak 1000 --clients 32 --requests 2 \
        --json results/soak_load_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from benchmarks.load_test import PROMPTS, percentile, rss_mb, start_server
from verispec.bench.script import command_line


def cpu_name() -> str:
    """The CPU model and the flags that decide the kernels (AVX-512 bf16, AMX), from /proc/cpuinfo."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    return " ".join([name] + [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags])


def runners_phase(model_name: str, count: int, dtype: str) -> dict:
    from verispec.backends.fast import FastRunner
    from verispec.models import load_model

    pid = os.getpid()
    before = rss_mb(pid)
    target = load_model(model_name, dtype=dtype)
    loaded = rss_mb(pid)
    rss, runners = [], []
    for _ in range(count):
        runners.append(FastRunner(target.model, capacity=target.context_length + 256))
        runners[-1].forward(list(range(1, 33)), last_only=True)  # touch the cache and the weights
        rss.append(rss_mb(pid))
    r = runners[0]
    per_slot = sum(t[:, :1].numel() * t.element_size() for t in r.kv)
    return {"dtype": dtype, "rss_mb_start": round(before, 1), "rss_mb_model_loaded": round(loaded, 1),
            "rss_mb_after_each_runner": [round(x, 1) for x in rss],
            "first_runner_mb": round(rss[0] - loaded, 1),
            "further_runner_mb": [round(b - a, 1) for a, b in zip(rss, rss[1:])],
            "runners_share_weights": all(x.net is r.net for x in runners),
            "kv_bytes_per_slot": per_slot, "kv_slots_allocated": r.allocated, "kv_slots_max": r.slots_total,
            "kv_mb_allocated": round(per_slot * r.allocated / 2 ** 20, 1),
            "kv_mb_max": round(per_slot * r.slots_total / 2 ** 20, 1)}


def soak_phase(url: str, model: str, pid: int, n: int) -> dict:
    statuses: dict[str, int] = {}
    samples, lat = [], []
    bad_ok = 0
    t0 = time.perf_counter()
    with httpx.Client(timeout=120) as http:
        for i in range(n):
            if i % 100 == 0:
                samples.append({"request": i, "rss_mb": round(rss_mb(pid), 1)})
            body = {"model": model, "max_tokens": 1 + i % 2, "temperature": 0,
                    "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                    "verispec": {"method": "ngram" if i % 2 else "ar"}}
            if i % 10 == 9:  # a bad request among the good ones
                body["verispec"] = {"tree": [[999999]]} if i % 20 == 9 else {"exact": "yes"}
            s = time.perf_counter()
            r = http.post(url + "/v1/chat/completions", json=body)
            lat.append(time.perf_counter() - s)
            statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1
            if i % 10 == 9 and r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}:
                bad_ok += 1
    samples.append({"request": n, "rss_mb": round(rss_mb(pid), 1)})
    wall = time.perf_counter() - t0
    first = samples[1]["rss_mb"] if len(samples) > 2 else samples[0]["rss_mb"]  # after 100: warmed up
    return {"requests": n, "statuses": statuses, "bad_requests_answered_400": bad_ok, "wall_s": round(wall, 1),
            "latency_p50_s": round(percentile(lat, 0.5), 3), "latency_p95_s": round(percentile(lat, 0.95), 3),
            "rss_samples": samples, "rss_mb_growth_after_warmup": round(samples[-1]["rss_mb"] - first, 1)}


def load_phase(url: str, model: str, pid: int, clients: int, requests: int, max_tokens: int) -> dict:
    results, lock = [], threading.Lock()
    rss_before = rss_mb(pid)

    def client(i: int) -> None:
        with httpx.Client(timeout=600) as http:
            for j in range(requests):
                body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                        "messages": [{"role": "user", "content": PROMPTS[(i + j) % len(PROMPTS)]}]}
                t0, refused, status = time.perf_counter(), 0, None
                while True:
                    try:
                        r = http.post(url + "/v1/chat/completions", json=body)
                        status = r.status_code
                    except httpx.HTTPError as exc:
                        status = type(exc).__name__
                        break
                    if status != 429:
                        break
                    refused += 1
                    time.sleep(float(r.headers.get("Retry-After", "1")))
                with lock:
                    results.append({"status": status, "refused": refused, "latency": time.perf_counter() - t0})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["status"] == 200]
    lat = [r["latency"] for r in ok]
    return {"clients": clients, "requests_per_client": requests, "max_tokens": max_tokens, "sent": len(results),
            "served": len(ok), "lost": len(results) - len(ok),
            "statuses": {str(s): sum(1 for r in results if r["status"] == s) for s in {r["status"] for r in results}},
            "answered_429_then_retried": sum(r["refused"] for r in results), "wall_s": round(wall, 1),
            "latency_p50_s": round(percentile(lat, 0.5), 2), "latency_p95_s": round(percentile(lat, 0.95), 2),
            "rss_mb_before": round(rss_before, 1), "rss_mb_after": round(rss_mb(pid), 1)}


def long_phase(url: str, model: str, tokens: int) -> dict:
    prompt = " ".join(["word"] * tokens)
    with httpx.Client(timeout=600) as http:
        t0 = time.perf_counter()
        r = http.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 200,
                                                     "verispec": {"timeout": 1}})
        took = time.perf_counter() - t0
        code = r.json().get("error", {}).get("code") if r.status_code != 200 else None
        t1 = time.perf_counter()
        nxt = http.post(url + "/v1/chat/completions", json={"model": model, "max_tokens": 2,
                                                            "messages": [{"role": "user", "content": "hi"}]})
        return {"prompt_words": tokens, "status": r.status_code, "code": code, "answered_after_s": round(took, 2),
                "next_request_status": nxt.status_code, "next_request_s": round(time.perf_counter() - t1, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--phases", default="runners,soak,load,long")
    ap.add_argument("--runners", type=int, default=4, help="runners built in the runners phase")
    ap.add_argument("--soak", type=int, default=1000, help="sequential requests")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=2, help="requests per client in the load phase")
    ap.add_argument("--max-tokens", type=int, default=2, help="max_tokens of the load phase")
    ap.add_argument("--long-tokens", type=int, default=2000)
    ap.add_argument("--port", type=int, default=8766)
    ap.add_argument("--max-queue", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()
    phases = args.phases.split(",")
    report: dict = {"command": command_line(), "model": args.model, "machine": cpu_name(),
                    "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg(),
                    "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    if "runners" in phases:
        report["runners"] = runners_phase(args.model, args.runners, args.dtype)
        print(json.dumps(report["runners"], indent=2), flush=True)
    if any(p in phases for p in ("soak", "load", "long")):
        server_args = argparse.Namespace(model=args.model, method="ngram", port=args.port, max_queue=args.max_queue,
                                         timeout=300.0, threads=args.threads)
        proc, url = start_server(server_args)
        try:
            model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            httpx.post(url + "/v1/chat/completions", timeout=120,
                       json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            report["server_rss_mb_after_warmup"] = round(rss_mb(proc.pid), 1)
            for name, run in (("soak", lambda: soak_phase(url, model, proc.pid, args.soak)),
                              ("load", lambda: load_phase(url, model, proc.pid, args.clients, args.requests,
                                                          args.max_tokens)),
                              ("long", lambda: long_phase(url, model, args.long_tokens))):
                if name in phases:
                    report[name] = run()
                    print(name, json.dumps(report[name]), flush=True)
            metrics = httpx.get(url + "/metrics", timeout=10).text
            report["server_runners_built"] = next((float(line.split()[-1]) for line in metrics.splitlines()
                                                   if line.startswith("verispec_runners_built_total")), None)
            counts = [line for line in metrics.splitlines() if line.startswith("verispec_requests_total")]
            report["server_500"] = sum(float(line.split()[-1]) for line in counts if 'status="500"' in line)
            report["server_5xx"] = sum(float(line.split()[-1]) for line in counts if 'status="5' in line)
            report["server_rss_mb_end"] = round(rss_mb(proc.pid), 1)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if not isinstance(v, dict)}, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
