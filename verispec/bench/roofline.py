"""The roofline probe: how much one target forward costs as the number of new positions N grows.

Batch-1 decoding is memory-bandwidth bound: every forward streams all weights once, so scoring N
drafted positions costs about as much as scoring one until compute catches up. This module measures
that curve on the machine at hand (the same runner forward + crop the engine verifies with: the fast
path where the family has one, else transformers; `backend` chooses as the engine's option does), the
copy bandwidth, and the weight bytes, and derives the bandwidth floor and the "free" N.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from verispec.errors import InvalidParameter

FREE_FACTOR = 1.25  # a width costs "nothing" while it stays under 1.25x the N = 1 forward


def default_ns(max_n: int = 256) -> list[int]:
    if max_n < 1:
        raise InvalidParameter(f"max N must be >= 1, got {max_n}")
    ns, n = [], 1
    while n <= max_n:
        ns.append(n)
        n *= 2
    if ns[-1] != max_n:
        ns.append(max_n)
    return ns


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes(model: torch.nn.Module) -> dict:
    """Bytes of parameters, counted once per storage (tied embeddings are one matrix).

    `streamed` leaves out an input embedding that is not tied to the output head: a forward reads only
    the looked-up rows of it, while every other matrix is read whole."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        key = p.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += p.numel() * p.element_size()
    streamed = total
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if emb is not None and (out is None or emb.weight.data_ptr() != out.weight.data_ptr()):
        streamed -= emb.weight.numel() * emb.weight.element_size()
    return {"total": int(total), "streamed": int(streamed)}


def copy_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = 5) -> dict:
    """Memory bandwidth from a large device-to-device copy: bytes read + bytes written per second."""
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults are not bandwidth
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    del src, dst
    return {"bytes": int(n * 4), "median_s": med, "times_s": times, "gb_per_s": 2 * n * 4 / med / 1e9}


def measure(target, context: int = 200, ns: list[int] | None = None, repeats: int = 7, warmup: int = 2,
            seed: int = 0, bandwidth_bytes: int | None = None, progress: Callable[[int], None] | None = None,
            backend: str = "auto") -> dict:
    """Time one forward over N new positions after `context` cached positions, for each N.

    target: a LoadedModel; backend: auto, hf or fast (the fast runner runs every row as it would in a
    verification pass: exact mode off, so N rows cost N rows). Returns a JSON-ready dict: points (n, median_s, times_s), bandwidth, weight
    bytes, the bandwidth floor for one forward and the free positions."""
    from verispec.backends import make_runner
    from verispec.backends.fast import FastRunner

    ns = sorted(set(ns or default_ns(256)))
    if ns[0] < 1:
        raise InvalidParameter("N must be >= 1")
    if 1 not in ns:
        ns = [1] + ns
    if context < 1:
        raise InvalidParameter(f"context must be >= 1, got {context}")
    if repeats < 1 or warmup < 0:
        raise InvalidParameter("repeats must be >= 1 and warm-up >= 0")
    if context + ns[-1] > target.context_length:
        raise InvalidParameter(f"context {context} + N {ns[-1]} exceeds the model's {target.context_length} positions; "
                               "lower --context or --max-n")
    device = target.device
    runner = make_runner(target.model, backend, exact=False, weights=target.weights,
                         weight_source=target.weight_source)
    gen = torch.Generator().manual_seed(seed)
    vocab = target.vocab_size
    ctx_ids = torch.randint(0, vocab, (context,), generator=gen).tolist()
    runner.reset()
    runner.forward(ctx_ids, last_only=True)
    points = []
    for n in ns:
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        for _ in range(warmup):
            runner.forward(ids)
            runner.rollback(context)
        times = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            runner.forward(ids)  # logits for every position, as verification needs
            _sync(device)
            times.append(time.perf_counter() - t0)
            runner.rollback(context)
        points.append({"n": n, "median_s": statistics.median(times), "min_s": min(times), "times_s": times})
        if progress is not None:
            progress(n)
    runner.reset()
    bw = copy_bandwidth(device, bandwidth_bytes)
    wb = weight_bytes(target.model)
    fmt = runner.net.weights if isinstance(runner, FastRunner) else "bf16"
    if fmt != "bf16":  # quantized (fast/quant.py): the floor is set by the bytes of that format
        wb = {**wb, "streamed": runner.net.streamed_bytes()}
    return summarize({
        "schema": "verispec-roofline/1",
        "model": target.name,
        "dtype": str(target.dtype).replace("torch.", ""),
        "device": str(device),
        "backend": "fast" if isinstance(runner, FastRunner) else "hf",
        "weights": fmt,
        "context": context,
        "repeats": repeats,
        "warmup": warmup,
        "points": points,
        "bandwidth": bw,
        "weight_bytes": wb,
    })


def summarize(result: dict) -> dict:
    """Add the derived figures (floor, distance to it, free positions) to a measured result."""
    pts = result["points"]
    t1 = next(p["median_s"] for p in pts if p["n"] == 1)
    floor = result["weight_bytes"]["streamed"] / (result["bandwidth"]["gb_per_s"] * 1e9)
    # the widest N with it and every narrower width under the factor: a noisy wide point under it
    # after a narrow one over it is not "free"
    free = 1
    for p in sorted(pts, key=lambda p: p["n"]):
        if p["median_s"] >= FREE_FACTOR * t1:
            break
        free = p["n"]
    for p in pts:
        p["ratio"] = p["median_s"] / t1
        p["per_position_s"] = p["median_s"] / p["n"]
    result.update(t1_s=t1, floor_s=floor, floor_ratio=t1 / floor if floor > 0 else float("inf"),
                  free_factor=FREE_FACTOR, free_positions=free)
    return result


def format_table(result: dict) -> str:
    lines = [f"roofline: {result['model']} ({result['dtype']}, {result['device']}, {result.get('backend', 'hf')} backend), context {result['context']}, "
             f"median of {result['repeats']} after {result['warmup']} warm-up",
             f"{'N':>5} {'forward ms':>11} {'x N=1':>7} {'ms/position':>12}"]
    for p in result["points"]:
        lines.append(f"{p['n']:>5} {p['median_s'] * 1e3:>11.2f} {p['ratio']:>7.2f} {p['per_position_s'] * 1e3:>12.3f}")
    wb, bw = result["weight_bytes"], result["bandwidth"]
    lines += [
        f"weights: {wb['streamed'] / 1e6:.1f} MB streamed per forward ({wb['total'] / 1e6:.1f} MB of parameters)",
        f"copy bandwidth: {bw['gb_per_s']:.1f} GB/s (read + write, {bw['bytes'] >> 20} MiB copy)",
        f"bandwidth floor for one forward: {result['floor_s'] * 1e3:.2f} ms; measured N=1 is "
        f"{result['t1_s'] * 1e3:.2f} ms = {result['floor_ratio']:.1f}x the floor",
        f"free positions (largest N under {result['free_factor']}x of N=1): {result['free_positions']}",
    ]
    return "\n".join(lines)
