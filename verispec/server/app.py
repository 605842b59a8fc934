"""The FastAPI app: OpenAI-compatible endpoints over one loaded model, /metrics, and the live page.

    POST /v1/chat/completions, POST /v1/completions   (stream: true -> server-sent events)
    GET  /v1/models, /v1/models/{id}, /health, /metrics, /verispec/info, /openapi.json, /
    POST /v1/verispec/race                            (extension: several methods, same prompt)

Every request builds its own Engine with verispec.api.build_engine (cheap: the target model is loaded
once; an engine holds a KV cache and a small drafter), then waits in the fair FIFO queue of
scheduler.Scheduler for an engine thread. Speculation settings come from the server's defaults,
overridden per request by the extension object "verispec" in the body; statistics go back in a
"verispec" field of every response and stream chunk (OpenAI clients ignore unknown fields).

Hardening (what a hostile or careless client cannot do): the Host header must name an allowed host
(DNS rebinding cannot reach a loopback server from a web page); with an API key, /v1 and /metrics
need it (/verispec/info stays open: the page reads it before a key is typed, and it holds the model
name, methods, defaults and limits, nothing more); every failure, an unexpected exception included,
ends as an OpenAI error object on a connection that stays usable; the prompt is limited well under
the context by default and its prefill is stopped between chunks by a timeout or a disconnect.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import logging
import math
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

from verispec.api import build_engine
from verispec.drafters import METHODS
from verispec.errors import VerispecError
from verispec.options import SpeculationSettings
from verispec.server import errors
from verispec.server.errors import APIError, verispec_error
from verispec.server.metrics import ServerMetrics
from verispec.server.scheduler import Job, QueueFull, Scheduler
from verispec.server.schemas import ChatCompletionRequest, CompletionRequest, RaceRequest, SpeculationOptions
from verispec.server.work import RunnerPool, run_generation, run_race
from verispec.types import SamplingParams

STATIC = Path(__file__).parent / "static"
log = logging.getLogger("verispec.server")

# build_engine keywords a request may not set: the target is the served model; the draft model and a
# drafter head are whatever the server was started with (a request naming a path would make the server
# load files of the client's choosing); runners are pooled by the server; compiling takes minutes; the
# verification cost curve is measured by the server
_RESERVED = {"target", "draft", "head", "runner", "compile", "verify_cost"}


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass
class ServerConfig:
    """Defaults and limits of a server. Limits are what a request may ask for at most."""

    model_name: str | None = None          # the id clients send as "model" (default: the model's name)
    method: str = "ar"                     # default speculation method
    draft_length: int = 5
    adaptive: bool = False
    engine_options: dict[str, Any] = field(default_factory=dict)  # more build_engine defaults
    default_max_tokens: int = 256
    max_tokens: int = 2048
    # a prompt's prefill holds a worker (2,000 tokens of SmolLM2-135M: seconds on a 2-core CPU), so the
    # default stays well under the context; None: the model's context length - 1
    max_prompt_tokens: int | None = 2048
    max_body_bytes: int = 1 << 20
    max_queue: int = 16
    timeout: float = 300.0                 # seconds from arrival to the last token, queue wait included
    api_key: str | None = None
    workers: int = 1
    keep_runners: int = 2                  # idle runners kept per runner configuration (see work.RunnerPool)
    # Host header values answered (any port); "*" = any. Loopback names by default, so a web page cannot
    # reach a keyless local server through DNS rebinding
    allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS


def host_name(header: str) -> str:
    """The host of a Host header without its port: "[::1]:8000" -> "::1", "a.b:80" -> "a.b"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


def _engine_keywords(factory) -> set[str]:
    return {name for name, p in inspect.signature(factory).parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - _RESERVED


class _Guard:
    """ASGI middleware: allowed hosts, API key on /v1 and /metrics, body size limit (declared and
    actual), per-request metrics, and the last word on unexpected exceptions.

    The body is read here up to the limit and replayed to the app, so a chunked body without a
    Content-Length cannot slip past the limit. An exception that escapes the app is answered here with
    a generic 500 OpenAI error (or, when the response had started, the body is ended) and not passed on:
    uvicorn would otherwise drop the keep-alive connection without a `Connection: close`, and the
    client's next request on it would fail.
    """

    ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/verispec/race",
                 "/health", "/metrics", "/verispec/info", "/openapi.json", "/")

    def __init__(self, app, config: ServerConfig, metrics: ServerMetrics):
        self.app, self.config, self.metrics = app, config, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.monotonic()
        path = scope.get("path", "")
        endpoint = path if path in self.ENDPOINTS else ("/v1/models" if path.startswith("/v1/models/") else
                                                         "/static" if path.startswith("/static/") else "other")
        status = {"code": 500}

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self.metrics.request_done(endpoint, status["code"], time.monotonic() - t0)

        started = {"yes": False, "done": False}

        async def tracked_send(message):
            if message["type"] == "http.response.start":
                started["yes"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                started["done"] = True
            await counted_send(message)

        try:
            err = self._check_host(scope) or self._check_key(scope, path)
            if err is None:
                err, receive = await self._check_body(scope, receive)
            if err is not None:
                headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
                return await err.response(headers)(scope, receive, tracked_send)
            await self.app(scope, receive, tracked_send)
        except Exception:
            log.exception("unhandled error on %s %s", scope.get("method"), path)
            if not started["yes"]:
                await errors.internal_error().response()(scope, receive, tracked_send)
            elif not started["done"]:  # mid-stream: end the body so the connection stays in a known state
                try:
                    await tracked_send({"type": "http.response.body", "body": b"", "more_body": False})
                except Exception:  # noqa: BLE001 - the client is gone; nothing more to do
                    pass

    def _check_host(self, scope) -> APIError | None:
        allowed = self.config.allowed_hosts
        if "*" in allowed:
            return None
        raw = dict(scope.get("headers") or []).get(b"host")
        if raw is None:  # HTTP/1.0 without Host: not a browser, so not DNS rebinding
            return None
        host = host_name(raw.decode("latin-1"))
        if host in {h.lower() for h in allowed}:
            return None
        return APIError(400, f"this server does not answer to the host '{host[:100]}'; use one of "
                             f"{', '.join(allowed)} (or start it with --allowed-host {host[:100] or 'NAME'})",
                        code="invalid_host")

    def _check_key(self, scope, path: str) -> APIError | None:
        if not self.config.api_key or not (path.startswith("/v1") or path == "/metrics"):
            return None
        auth = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return APIError(401, "this server needs an API key: send the header 'Authorization: Bearer <key>'",
                            code="missing_api_key")
        if not hmac.compare_digest(token.strip().encode(), self.config.api_key.encode()):
            return APIError(401, "the API key is wrong; use the key the server was started with (--api-key)",
                            code="invalid_api_key")
        return None

    async def _check_body(self, scope, receive):
        limit = self.config.max_body_bytes
        too_big = APIError(413, f"the request body is larger than this server's limit of {limit} bytes; "
                                "send a shorter prompt", code="request_too_large")
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return None, receive
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                if int(declared) > limit:
                    return too_big, receive
            except ValueError:
                return APIError(400, "the Content-Length header is not a number", code="invalid_header"), receive
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return APIError(400, "the client disconnected while sending the body"), receive
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return too_big, receive
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for http.disconnect, as the app expects

        return None, replay


class _ClientGone(Exception):
    pass


def _signature_source(factory):
    """Which callable's keywords a custom engine factory accepts: a factory taking **options is
    taken to accept build_engine's."""
    params = inspect.signature(factory).parameters.values()
    return build_engine if any(p.kind == p.VAR_KEYWORD for p in params) else factory


def create_app(target, config: ServerConfig | None = None, draft=None,
               engine_factory: Callable[..., Any] | None = None) -> FastAPI:
    """An app serving `target` (a verispec LoadedModel).

    draft: a LoadedModel for method "draft" (loaded once by the caller).
    engine_factory(target, **options) -> Engine: defaults to verispec.api.build_engine; tests wrap it.
    """
    config = config or ServerConfig()
    name = config.model_name or target.name
    max_prompt = min(config.max_prompt_tokens or target.context_length - 1, target.context_length - 1)
    factory = engine_factory or build_engine
    # the options a request may set: the shared schema's (verispec.options), where the factory takes them
    allowed = set(SpeculationSettings.model_fields) & _engine_keywords(
        build_engine if engine_factory is None else _signature_source(engine_factory))
    metrics = ServerMetrics()
    pool = RunnerPool(factory, keep=config.keep_runners)
    metrics.runners = lambda: pool.built
    scheduler: Scheduler | None = None
    created = int(time.time())
    methods = [m for m in METHODS if m != "draft" or draft is not None]

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal scheduler
        scheduler = Scheduler(config.max_queue, config.workers, metrics)
        app.state.scheduler = scheduler
        try:
            yield
        finally:
            scheduler.close()

    # /openapi.json describes the API for clients' tools (and the fuzz test); no docs pages are served
    app = FastAPI(title="verispec", summary="OpenAI-compatible speculative decoding server", lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.metrics = metrics
    app.state.config = config
    errors.install(app)
    app.add_middleware(_Guard, config=config, metrics=metrics)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    # --- building a job ----------------------------------------------------------------------
    def check_model(model: str) -> None:
        if model != name:
            raise APIError(404, f"the model '{model}' is not served here; use '{name}' (GET /v1/models lists it)",
                           param="model", code="model_not_found")

    def check_supported(body) -> None:
        for param, reason in body.unsupported():
            raise APIError(400, reason, param=param, code="unsupported_parameter")

    def sampling(temperature, top_p, top_k, seed, max_tokens, stop) -> SamplingParams:
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

    def engine_options(opts: SpeculationOptions | None, param: str = "verispec") -> dict:
        """The server's defaults overridden by the request's extension object, checked by name here;
        values are checked when the engine is built (in the worker, see build)."""
        options = {"method": config.method, "draft_length": config.draft_length, "adaptive": config.adaptive,
                   **config.engine_options}
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
                if key not in allowed:
                    raise APIError(400, f"unknown speculation option '{key[:60]}'; use one of: "
                                        f"{', '.join(sorted(allowed))}", param=f"{param}.{key[:60]}", code="invalid_value")
            options.update(requested)
        method = options.get("method")
        if method not in METHODS:
            raise APIError(400, f"unknown method '{method}'; use one of: {', '.join(methods)}",
                           param=f"{param}.method", code="invalid_value")
        if method == "draft" and draft is None:
            raise APIError(400, "this server has no draft model, so method 'draft' is unavailable; start it with "
                                f"--draft MODEL or use one of: {', '.join(methods)}", param=f"{param}.method",
                           code="invalid_value")
        return options

    def build(options: dict, param: str = "verispec"):
        """(engine, pool key), in the worker thread; bad option values become a 400."""
        try:
            return pool.build(target, draft, options)
        except VerispecError as exc:
            raise APIError(400, str(exc), param=param, code="invalid_value") from exc
        except TypeError as exc:  # a custom engine factory refused an option the schema let through
            raise APIError(400, "these speculation options are not accepted by this server's engine: "
                                f"{', '.join(sorted(options))[:300]}", param=param, code="invalid_value") from exc

    def generation_work(options: dict, ids: list[int], params: SamplingParams) -> Callable[[Job], None]:
        def work(job: Job) -> None:
            engine, key = build(options)
            try:
                run_generation(job, engine, ids, params, target.decode, metrics)
            finally:
                pool.release(engine, key)
        return work

    async def encode(param: str, prompt: str | None = None, chat: list[dict] | None = None,
                     ids: list[int] | None = None) -> list[int]:
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
        if len(ids) > max_prompt:
            raise APIError(400, f"the prompt has {len(ids)} tokens but this server accepts at most {max_prompt}; "
                                "shorten it", param=param, code="context_length_exceeded")
        return ids

    def submit(work: Callable[[Job], None], opts: SpeculationOptions | None) -> Job:
        timeout = config.timeout if opts is None or opts.timeout is None else min(config.timeout, opts.timeout)
        job = Job(work, asyncio.get_running_loop(), timeout)
        try:
            scheduler.submit(job)
        except QueueFull as exc:
            raise APIError(429, f"the server is busy: {exc}; retry in a few seconds", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": str(retry_after())}) from exc
        return job

    def retry_after() -> int:
        """Seconds until a place in the queue is likely free: the mean time of a served request, 1 to 60."""
        mean = metrics.latency.sum / metrics.latency.count if metrics.latency.count else 1.0
        return int(min(60, max(1, math.ceil(mean))))

    def timeout_error(job: Job) -> APIError:
        return APIError(504, f"the request took longer than the server's limit of {job.timeout:g} s; ask for "
                             "fewer max_tokens or retry when the server is less busy", type="timeout_error",
                        code="timeout")

    async def next_item(job: Job, request: Request | None) -> tuple[str, Any]:
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
                if scheduler.withdraw(job):
                    metrics.cancel("disconnect")
                    raise _ClientGone()
            if time.monotonic() > job.deadline:
                job.cancel("timeout")
                if scheduler.withdraw(job):
                    metrics.cancel("timeout")
                raise timeout_error(job)

    def cancelled_error(job: Job, reason: str) -> Exception:
        if reason == "timeout":
            return timeout_error(job)
        if reason == "disconnect":
            return _ClientGone()
        return APIError(503, "the server is shutting down; retry later", type="server_error", code="shutdown")

    # --- response shapes ---------------------------------------------------------------------
    def usage(gen) -> dict:
        p, c = len(gen.prompt_ids), len(gen.token_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def spec_stats(gen, job: Job | None = None) -> dict:
        s = gen.stats
        out = {"method": s.method, "drafted": s.drafted, "accepted": s.accepted,
               "acceptance_rate": round(s.acceptance_rate, 4), "mean_accepted_length": round(s.mean_accepted_length, 4),
               "steps": s.steps, "acceptance_by_position": [round(a, 4) for a in s.acceptance_by_position],
               "time_to_first_token": None if s.first_token_time is None else round(s.first_token_time, 4),
               "tokens_per_second": round(s.tokens_per_second, 2), "total_time": round(s.total_time, 4)}
        if job is not None:
            out["queue_time"] = round(job.queue_time, 4)
        return out

    def step_ext(event, pieces) -> dict:
        return {"step": event.step, "token_ids": event.token_ids, "kinds": event.kinds, "pieces": pieces}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def respond(request: Request, job: Job, stream: bool, include_usage: bool,
                      chunk: Callable[..., dict], final: Callable[..., dict], opening: dict | None = None) -> Response:
        """Wait for the job and answer: a JSON body from final(gen, job), or server-sent events: opening,
        then chunk(text, ext, finish, gen) per step and at the end."""
        try:
            if not stream:
                while True:
                    kind, payload = await next_item(job, request)
                    if kind == "done":
                        return JSONResponse(final(payload, job))
                    if kind == "error":
                        raise payload
                    if kind == "cancelled":
                        raise cancelled_error(job, payload)
            # wait for the first step before answering, so errors before it still get a real status
            kind, payload = await next_item(job, request)
        except _ClientGone:
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        if kind == "error":
            raise payload
        if kind == "cancelled":
            err = cancelled_error(job, payload)
            if isinstance(err, _ClientGone):
                return Response(status_code=499)
            raise err

        async def events(first) -> AsyncIterator[str]:
            finished = False
            try:
                if opening is not None:
                    yield sse(opening)
                item = first
                while True:
                    kind, payload = item
                    if kind == "step":
                        event, pieces = payload
                        yield sse(chunk(event.text, step_ext(event, pieces), None, None))
                    elif kind == "done":
                        yield sse(chunk(None, {"stats": spec_stats(payload, job)}, payload.finish_reason, payload))
                        if include_usage:
                            last = chunk(None, None, None, payload)
                            last["choices"] = []
                            yield sse(last)
                        break
                    else:
                        err = cancelled_error(job, payload) if kind == "cancelled" else \
                            APIError(500, "internal server error; the server log has the details", type="server_error")
                        if isinstance(err, APIError):
                            yield sse(err.body())
                        break
                    item = await job.items.get()
                yield "data: [DONE]\n\n"
                finished = True
            finally:
                if not finished:  # the response was cancelled: the client went away mid-stream
                    job.cancel("disconnect")

        return StreamingResponse(events((kind, payload)), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # --- endpoints ---------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        check_supported(body)
        params = sampling(body.temperature, body.top_p, body.top_k, body.seed, body.limit(), body.stop)
        options = engine_options(body.verispec)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = await encode("messages", chat=messages)
        job = submit(generation_work(options, ids, params), body.verispec)
        cid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text, ext, finish, gen, role=False):
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            out = {"id": cid, "object": "chat.completion.chunk", "created": now, "model": name,
                   "system_fingerprint": None,
                   "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
            if gen is not None:
                out["usage"] = usage(gen)
            if ext is not None:
                out["verispec"] = ext
            return out

        def final(gen, job):
            return {"id": cid, "object": "chat.completion", "created": now, "model": name, "system_fingerprint": None,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": gen.text},
                                 "logprobs": None, "finish_reason": gen.finish_reason}],
                    "usage": usage(gen), "verispec": spec_stats(gen, job)}

        include = bool(body.stream_options and body.stream_options.include_usage)
        return await respond(request, job, body.stream, include, chunk, final,
                             opening=chunk(None, None, None, None, role=True))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        check_supported(body)
        params = sampling(body.temperature, body.top_p, body.top_k, body.seed, body.limit(), body.stop)
        options = engine_options(body.verispec)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise APIError(400, "send one prompt per request (a string, or a list of one string)",
                               param="prompt", code="invalid_value")
            prompt = prompt[0]
        if isinstance(prompt, list):
            ids = await encode("prompt", ids=[int(i) for i in prompt])
        else:
            ids = await encode("prompt", prompt=prompt)
        job = submit(generation_work(options, ids, params), body.verispec)
        cid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text, ext, finish, gen):
            out = {"id": cid, "object": "text_completion", "created": now, "model": name,
                   "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]}
            if gen is not None:
                out["usage"] = usage(gen)
            if ext is not None:
                out["verispec"] = ext
            return out

        def final(gen, job):
            return {"id": cid, "object": "text_completion", "created": now, "model": name,
                    "choices": [{"index": 0, "text": gen.text, "logprobs": None, "finish_reason": gen.finish_reason}],
                    "usage": usage(gen), "verispec": spec_stats(gen, job)}

        include = bool(body.stream_options and body.stream_options.include_usage)
        return await respond(request, job, body.stream, include, chunk, final)

    @app.post("/v1/verispec/race")
    async def race(body: RaceRequest, request: Request):
        if (body.messages is None) == (body.prompt is None):
            raise APIError(400, "give either 'messages' or 'prompt'", param="messages", code="invalid_value")
        params = sampling(0.0 if body.temperature is None else body.temperature, body.top_p, None, body.seed,
                          body.max_tokens, ())
        lanes = body.lanes or [SpeculationOptions(method="ar"),
                               SpeculationOptions(method=config.method if config.method != "ar" else "ngram")]
        lane_options = [engine_options(lane, f"lanes.{i}") for i, lane in enumerate(lanes)]
        if body.messages is not None:
            ids = await encode("messages", chat=[{"role": m.role, "content": m.text()} for m in body.messages])
        else:
            ids = await encode("prompt", prompt=body.prompt)
        def race_work(job: Job) -> None:
            built = []
            try:
                for i, options in enumerate(lane_options):
                    built.append(build(options, f"lanes.{i}"))
                job.emit("lanes", [engine.method for engine, _ in built])
                run_race(job, [engine for engine, _ in built], ids, params, target.decode, metrics)
            finally:
                for engine, key in built:
                    pool.release(engine, key)

        job = submit(race_work, None)
        try:
            first = await next_item(job, request)
        except _ClientGone:
            return Response(status_code=499)
        if first[0] == "error":
            raise first[1]
        if first[0] == "cancelled":
            raise cancelled_error(job, first[1])
        async def events() -> AsyncIterator[str]:
            finished = False
            try:
                kind, payload = first
                while True:
                    if kind == "lanes":
                        yield sse({"lanes": payload, "prompt_tokens": len(ids)})
                    elif kind == "step":
                        lane, event, pieces, elapsed = payload
                        yield sse({"lane": lane, "elapsed": round(elapsed, 4), **step_ext(event, pieces),
                                   "text": event.text})
                    elif kind == "lane_done":
                        lane, gen, elapsed = payload
                        yield sse({"lane": lane, "done": True, "elapsed": round(elapsed, 4),
                                   "finish_reason": gen.finish_reason, "usage": usage(gen), "stats": spec_stats(gen)})
                    elif kind == "done":
                        break
                    else:
                        err = cancelled_error(job, payload) if kind == "cancelled" else APIError(500, "internal server error")
                        if isinstance(err, APIError):
                            yield sse(err.body())
                        break
                    kind, payload = await job.items.get()
                yield "data: [DONE]\n\n"
                finished = True
            finally:
                if not finished:
                    job.cancel("disconnect")

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "verispec"}]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        check_model(model_id)
        return {"id": name, "object": "model", "created": created, "owned_by": "verispec"}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "queued": scheduler.waiting if scheduler else 0}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/verispec/info")
    async def info():
        return {"model": name, "methods": methods, "draft_model": draft.name if draft is not None else None,
                "defaults": {"method": config.method, "draft_length": config.draft_length, "adaptive": config.adaptive,
                             "max_tokens": config.default_max_tokens, **config.engine_options},
                "limits": {"max_tokens": config.max_tokens, "max_prompt_tokens": max_prompt,
                           "max_body_bytes": config.max_body_bytes, "max_queue": config.max_queue,
                           "timeout": config.timeout},
                "api_key_required": bool(config.api_key)}

    @app.get("/")
    async def page():
        return FileResponse(STATIC / "index.html")

    return app
