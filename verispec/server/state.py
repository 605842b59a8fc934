"""What every request handler shares: one `Served` per app (model, limits, runner pool, queue), kept on
app.state and handed to the handlers as a FastAPI dependency.

Its methods turn a request into a job (sampling parameters, engine options checked against the server's
settings, the prompt's ids) and wait for the job's reports with the queue's deadline and disconnect rules.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, Callable

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from verispec.api import build_engine
from verispec.batch import cost_envelope
from verispec.drafters import METHODS
from verispec.errors import VerispecError
from verispec.options import LOCAL_OPTIONS, WIRE_OPTIONS
from verispec.server.errors import APIError, verispec_error
from verispec.server.metrics import ServerMetrics
from verispec.server.scheduler import Job, QueueFull, Scheduler
from verispec.server.schemas import SpeculationOptions
from verispec.server.work import BatchedGeneration, RunnerPool
from verispec.tree import measure_verify_cost
from verispec.types import SamplingParams

# options a request may not set: the target is the served model; runners are pooled by the server; the
# rest are verispec.options.LOCAL_OPTIONS (the draft model and a drafter head are whatever the server was
# started with, compiling takes minutes, the weights are the served model's, the cost curve is measured here)
_RESERVED = {"target", "runner", *LOCAL_OPTIONS}


class ClientGone(Exception):
    pass


def served(request: Request) -> "Served":
    """The handlers' dependency: the app's shared state."""
    return request.app.state.served


class Served:
    """One served model with its defaults, limits, metrics, runner pool and (while the app runs) queue."""

    def __init__(self, target, config, draft=None, engine_factory: Callable[..., Any] | None = None):
        self.target, self.config, self.draft = target, config, draft
        self.name = config.model_name or target.name
        self.max_prompt = min(config.max_prompt_tokens or target.context_length - 1, target.context_length - 1)
        # the options a request may set: the request form's (verispec.options.SpeculationChoices)
        self.allowed = set(WIRE_OPTIONS) - _RESERVED
        self.metrics = ServerMetrics()
        # a batch holds one runner per sequence: keep that many idle, so a steady load reuses them
        self.pool = RunnerPool(engine_factory or build_engine,
                               keep=max(config.keep_runners, config.max_batch * config.workers))
        self.verify_cost: dict[int, float] | None = None   # the cost curve behind batch_positions "auto"
        self.metrics.runners = lambda: self.pool.built
        self.scheduler: Scheduler | None = None
        self.created = int(time.time())
        self.methods = [m for m in METHODS if m != "draft" or draft is not None]

    # --- building a job ----------------------------------------------------------------------
    def check_model(self, model: str) -> None:
        if model != self.name:
            raise APIError(404, f"the model '{model}' is not served here; use '{self.name}' (GET /v1/models lists it)",
                           param="model", code="model_not_found")

    def settings(self, body) -> tuple[SamplingParams, dict]:
        """An OpenAI request's (sampling parameters, engine options), checked in this order: the model, the
        parameters this server refuses, the sampling parameters, the speculation options."""
        self.check_model(body.model)
        for param, reason in body.unsupported():
            raise APIError(400, reason, param=param, code="unsupported_parameter")
        params = self.sampling(body.temperature, body.top_p, body.top_k, body.seed, body.limit(), body.stop)
        return params, self.engine_options(body.verispec)

    def sampling(self, temperature, top_p, top_k, seed, max_tokens, stop) -> SamplingParams:
        config = self.config
        n = max_tokens if max_tokens is not None else config.default_max_tokens
        if n > config.max_tokens:
            raise APIError(400, f"max_tokens is {n} but this server allows at most {config.max_tokens}; ask for fewer",
                           param="max_tokens", code="max_tokens_too_large")
        try:
            # OpenAI's default temperature is 1.0; 0 is greedy
            return SamplingParams(temperature=1.0 if temperature is None else temperature,
                                  top_p=1.0 if top_p is None else top_p, top_k=top_k or 0, seed=seed,
                                  max_new_tokens=n, stop=tuple(stop or ()))
        except VerispecError as exc:
            word = str(exc).split(" ", 1)[0]  # the messages start with the parameter's name
            raise verispec_error(exc, word if word in ("temperature", "top_p", "top_k", "seed") else None) from exc

    def engine_options(self, opts: SpeculationOptions | None, param: str = "verispec") -> dict:
        """The engine factory's options by flat name: the server's settings overridden by the request's
        extension object, checked as one SpeculationSettings here (relations between options, such as
        ngram_min <= ngram_max, are judged when the engine is built, in the worker: see build)."""
        config, draft, methods = self.config, self.draft, self.methods
        requested = {}
        if opts is not None:
            requested = opts.engine_options()
            if "draft" in requested and (draft is None or requested["draft"] != draft.name):
                have = f"'{draft.name}'" if draft is not None else "none (start it with --draft MODEL)"
                raise APIError(400, f"a request cannot choose the draft model; this server's draft model is {have}",
                               param=f"{param}.draft", code="invalid_value")
            requested.pop("draft", None)
            for key in requested:
                if key in _RESERVED:
                    raise APIError(400, f"'{key}' is a server setting and cannot be set per request",
                                   param=f"{param}.{key}", code="invalid_value")
                if key not in self.allowed:
                    raise APIError(400, f"unknown speculation option '{key[:60]}'; use one of: "
                                        f"{', '.join(sorted(self.allowed))}", param=f"{param}.{key[:60]}",
                                   code="invalid_value")
        try:
            settings = config.settings.replace(**requested)
        except VerispecError as exc:
            raise APIError(400, str(exc), param=param, code="invalid_value") from exc
        if settings.method == "draft" and draft is None:
            raise APIError(400, "this server has no draft model, so method 'draft' is unavailable; start it with "
                                f"--draft MODEL or use one of: {', '.join(methods)}", param=f"{param}.method",
                           code="invalid_value")
        options = settings.flat()
        del options["draft"]  # the pool hands the factory the server's draft model
        return options

    def build(self, options: dict, param: str = "verispec"):
        """(engine, pool key), in the worker thread; bad option values become a 400."""
        try:
            return self.pool.build(self.target, self.draft, options)
        except VerispecError as exc:
            raise APIError(400, str(exc), param=param, code="invalid_value") from exc
        except TypeError as exc:  # a custom engine factory refused an option the schema let through
            raise APIError(400, "these speculation options are not accepted by this server's engine: "
                                f"{', '.join(sorted(options))[:300]}", param=param, code="invalid_value") from exc

    def generation_work(self, options: dict, ids: list[int], params: SamplingParams) -> BatchedGeneration:
        """The job's work: a generation that joins the engine thread's batch with its own engine."""
        return BatchedGeneration(lambda: self.build(options), self.pool.release, ids, params, self.target.decode,
                                 self.metrics)

    def step_positions(self) -> int | dict | None:
        """The batch's per-step budget of verified positions (scheduler.Scheduler asks once, in an engine
        thread): a number, None (each sequence drafts as alone; also when one sequence runs at a time), or
        for "auto" the cost curve measured on a runner of the server's default configuration, from which
        each step's Batch picks the budget at its current size (batch.free_positions)."""
        config = self.config
        if config.max_batch == 1 or config.batch_positions is None:
            return None
        if config.batch_positions != "auto":
            return config.batch_positions
        engine, key = self.pool.build(self.target, self.draft, self.engine_options(None))
        try:
            measured = measure_verify_cost(engine.runner, repeats=5)
        finally:
            self.pool.release(engine, key)
        self.verify_cost = cost_envelope(measured)
        return self.verify_cost

    async def encode(self, param: str, prompt: str | None = None, chat: list[dict] | None = None,
                     ids: list[int] | None = None) -> list[int]:
        target = self.target
        if ids is None:
            try:
                ids = await run_in_threadpool(target.encode, prompt, chat)
            except VerispecError as exc:
                raise APIError(400, str(exc), param=param, code="invalid_prompt") from exc
        else:
            bad = [i for i in ids if not (0 <= i < target.vocab_size)]
            if bad or not ids:
                raise APIError(400, f"token ids must be in [0, {target.vocab_size}) and the prompt non-empty",
                               param=param, code="invalid_prompt")
        if len(ids) > self.max_prompt:
            raise APIError(400, f"the prompt has {len(ids)} tokens but this server accepts at most {self.max_prompt}; "
                                "shorten it", param=param, code="context_length_exceeded")
        return ids

    def submit(self, work: Callable[[Job], None], opts: SpeculationOptions | None) -> Job:
        config = self.config
        timeout = config.timeout if opts is None or opts.timeout is None else min(config.timeout, opts.timeout)
        job = Job(work, asyncio.get_running_loop(), timeout)
        try:
            self.scheduler.submit(job)
        except QueueFull as exc:
            raise APIError(429, f"the server is busy: {exc}; retry in a few seconds", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": str(self.retry_after())}) from exc
        return job

    def retry_after(self) -> int:
        """Seconds until a place in the queue is likely free: the mean time of a served request, 1 to 60."""
        latency = self.metrics.latency
        mean = latency.sum / latency.count if latency.count else 1.0
        return int(min(60, max(1, math.ceil(mean))))

    # --- waiting for a job -------------------------------------------------------------------
    @staticmethod
    def timeout_error(job: Job) -> APIError:
        return APIError(504, f"the request took longer than the server's limit of {job.timeout:g} s; ask for "
                             "fewer max_tokens or retry when the server is less busy", type="timeout_error",
                        code="timeout")

    async def next_item(self, job: Job, request: Request | None) -> tuple[str, Any]:
        """The job's next report. While waiting, a gone client or a passed deadline withdraws a queued
        job at once; a running one stops at its next check (between steps or prefill chunks) and counts
        itself cancelled, and a passed deadline is answered now, not after that check."""
        while True:
            try:
                return await asyncio.wait_for(job.items.get(), timeout=0.25)
            except asyncio.TimeoutError:
                pass
            if request is not None and await request.is_disconnected():
                job.cancel("disconnect")
                if self.scheduler.withdraw(job):
                    self.metrics.cancel("disconnect")
                    raise ClientGone()
            if time.monotonic() > job.deadline:
                job.cancel("timeout")
                if self.scheduler.withdraw(job):
                    self.metrics.cancel("timeout")
                raise self.timeout_error(job)

    def cancelled_error(self, job: Job, reason: str) -> Exception:
        if reason == "timeout":
            return self.timeout_error(job)
        if reason == "disconnect":
            return ClientGone()
        return APIError(503, "the server is shutting down; retry later", type="server_error", code="shutdown")
