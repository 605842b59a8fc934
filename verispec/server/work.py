"""What an engine thread does for a request: run a generation (or a race of several) step by step,
report each step to the event loop, and stop between steps when the job is cancelled.

Each step's tokens are also decoded one by one ("pieces") so the page can colour every token by how
it was produced; the OpenAI text delta alone cannot say which characters came from which token.
"""

from __future__ import annotations

import time
from typing import Callable

from verispec.server.scheduler import Job


class PieceDecoder:
    """Text of each new token, decoded in the context of a few tokens before it.

    Decoding a token alone loses the leading space SentencePiece tokenizers drop at the start of a
    text, and splits multi-byte characters; so each piece is the difference between decoding a short
    window with and without the new tokens. A token that ends inside a character gets "" and the
    character goes to the token that completes it.
    """

    WINDOW = 6

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.done = 0   # tokens whose text has been handed out

    def add(self, token_ids: list[int]) -> list[str]:
        pieces = []
        for tok in token_ids:
            self.ids.append(tok)
            start = max(0, self.done - self.WINDOW)
            full = self.decode(self.ids[start:])
            if full.endswith("\ufffd"):
                pieces.append("")
                continue
            base = self.decode(self.ids[start:self.done])
            pieces.append(full[len(base):] if full.startswith(base) else full)
            self.done = len(self.ids)
        return pieces


def run_generation(job: Job, engine, prompt_ids: list[int], params, decode, metrics) -> None:
    """Stream one generation: emits ("step", (event, pieces)) per step, then ("done", Generation) or
    ("cancelled", reason)."""
    pieces = PieceDecoder(decode)
    stream = engine.stream(prompt_ids, params)
    reason = None
    try:
        for event in stream:
            metrics.step(len(event.token_ids))
            job.emit("step", (event, pieces.add(event.token_ids)))
            reason = job.stop_reason()
            if reason is not None:
                break
    finally:
        stream.close()  # stops the engine's generator: no further target forwards
    if reason is not None:
        metrics.cancel(reason)
        job.emit("cancelled", reason)
        return
    metrics.generation_done(engine.last.stats)
    job.emit("done", engine.last)


def run_race(job: Job, engines: list, prompt_ids: list[int], params, decode, metrics) -> None:
    """Decode the same prompt with several engines, interleaved on this one thread.

    Each lane keeps its own clock: the compute time of its own steps. The lane whose clock is behind
    runs next, so lanes advance in the order they would on separate identical machines, and each
    step is reported with its lane's clock ("elapsed"). Emits ("step", (lane, event, pieces,
    elapsed)), ("lane_done", (lane, Generation, elapsed)) per lane, then ("done", None) or
    ("cancelled", reason).
    """
    streams = [engine.stream(prompt_ids, params) for engine in engines]
    decoders = [PieceDecoder(decode) for _ in engines]
    clocks = [0.0] * len(engines)
    live = set(range(len(engines)))
    reason = None
    try:
        while live:
            lane = min(live, key=lambda i: clocks[i])
            t0 = time.perf_counter()
            try:
                event = next(streams[lane])
            except StopIteration:
                clocks[lane] += time.perf_counter() - t0
                live.discard(lane)
                metrics.generation_done(engines[lane].last.stats)
                job.emit("lane_done", (lane, engines[lane].last, clocks[lane]))
                continue
            clocks[lane] += time.perf_counter() - t0
            metrics.step(len(event.token_ids))
            job.emit("step", (lane, event, decoders[lane].add(event.token_ids), clocks[lane]))
            reason = job.stop_reason()
            if reason is not None:
                break
    finally:
        for s in streams:
            s.close()
    if reason is not None:
        metrics.cancel(reason)
        job.emit("cancelled", reason)
    else:
        job.emit("done", None)
