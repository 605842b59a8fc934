"""What an engine thread does for a request: a generation as a member of the thread's batch
(BatchedGeneration: scheduler.py steps it with the others), or a race of several engines run alone
(run_race); either reports each step to the event loop and stops when the job is cancelled: between
steps, and between the prompt's prefill chunks (should_stop), so a long prompt cannot hold the engine
thread past its deadline or its client.

Each step's tokens are also decoded one by one ("pieces") so the page can colour every token by how
it was produced; the OpenAI text delta alone cannot say which characters came from which token.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from verispec.options import BackendSettings, SpeculationSettings
from verispec.server.scheduler import Job, Member

# the options that decide what a runner is (verispec.options.BackendSettings); engines agreeing on them can
# share one
RUNNER_OPTIONS = tuple(f.alias for f in BackendSettings.model_fields.values())


class RunnerPool:
    """Runners kept between requests, so a request does not rebuild one.

    A runner (verispec.backends.fast.FastRunner) holds a fused copy of the target's weights and a KV cache, so
    building one per request would cost time and, with requests queued, memory per request. Engines
    themselves are cheap and built per job around a runner taken from here. At most `keep` idle
    runners are kept in all (a batch needs one per sequence at the same time, a race one per lane; the
    least recently used goes first). The verification cost curve an engine measured (tree budget
    "auto") is kept as well.
    """

    def __init__(self, factory: Callable[..., Any], keep: int = 2):
        self.factory, self.keep = factory, keep
        self._idle: list[tuple[tuple, Any]] = []   # (key, runner), least recently used first
        self._verify_cost: dict[tuple, dict] = {}
        self._lock = threading.Lock()
        self.built = 0   # runners built (engines that did not get a pooled runner)
        self._defaults = SpeculationSettings().flat()

    def key(self, options: dict) -> tuple:
        return tuple((k, repr(options.get(k, self._defaults.get(k)))) for k in RUNNER_OPTIONS)

    def build(self, target, draft, options: dict):
        """(engine, key): an engine for `options` around a pooled runner when one is idle."""
        key = self.key(options)
        runner = None
        with self._lock:
            for i in range(len(self._idle) - 1, -1, -1):
                if self._idle[i][0] == key:
                    runner = self._idle.pop(i)[1]
                    break
            cost = self._verify_cost.get(key)
        opts = dict(options)
        if cost is not None and opts.get("verify_cost") is None:
            opts["verify_cost"] = cost
        engine = self.factory(target, draft=draft, runner=runner, **opts)
        if runner is None:
            with self._lock:
                self.built += 1
        return engine, key

    def release(self, engine, key: tuple) -> None:
        runner, cost = engine.runner, engine.verify_cost
        with self._lock:
            if cost:
                self._verify_cost[key] = cost
            if all(r is not runner for _, r in self._idle):
                self._idle.append((key, runner))
                del self._idle[: max(0, len(self._idle) - self.keep)]


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


class BatchedGeneration(Member):
    """One request's generation as a member of the engine thread's batch (scheduler.Member).

    build() -> (engine, pool key) and release(engine, key) come from the server (its runner pool):
    each member gets its own engine, so its runner (KV cache), drafter and speculation settings are its
    own. Emits ("step", (event, pieces)) per step, then ("done", Generation) or ("cancelled", reason).
    """

    def __init__(self, build: Callable[[], tuple], release: Callable[[Any, tuple], None], prompt_ids: list[int],
                 params, decode: Callable[[list[int]], str], metrics):
        self.build, self.release = build, release
        self.prompt_ids, self.params, self.metrics = prompt_ids, params, metrics
        self.pieces = PieceDecoder(decode)
        self._engine: tuple | None = None

    def join(self, job: Job, batch):
        self._engine = self.build()
        return batch.add(self._engine[0], self.prompt_ids, self.params, should_stop=job.should_stop)

    def step(self, job: Job, event) -> None:
        self.metrics.step(len(event.token_ids))
        job.emit("step", (event, self.pieces.add(event.token_ids)))

    def leave(self, job: Job, run) -> None:
        self.abort(job)
        gen = run.result()
        if gen.finish_reason == "cancelled":
            reason = job.stop_reason() or "timeout"
            self.metrics.cancel(reason)
            job.emit("cancelled", reason)
            return
        self.metrics.generation_done(gen.stats)
        job.emit("done", gen)

    def abort(self, job: Job) -> None:
        """The engine goes back to the pool (its runner is reset when the next generation starts)."""
        if self._engine is not None:
            engine, key = self._engine
            self._engine = None
            self.release(engine, key)


def run_race(job: Job, engines: list, prompt_ids: list[int], params, decode, metrics) -> None:
    """Decode the same prompt with several engines, interleaved on this one thread.

    Each lane keeps its own clock: the compute time of its own steps. The lane whose clock is behind
    runs next, so lanes advance in the order they would on separate identical machines, and each
    step is reported with its lane's clock ("elapsed"). Emits ("step", (lane, event, pieces,
    elapsed)), ("lane_done", (lane, Generation, elapsed)) per lane, then ("done", None) or
    ("cancelled", reason).
    """
    stop = lambda: job.stop_reason() is not None  # noqa: E731
    streams = [engine.stream(prompt_ids, params, should_stop=stop) for engine in engines]
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
                if engines[lane].last.finish_reason == "cancelled":
                    reason = job.stop_reason() or "timeout"
                    break
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
