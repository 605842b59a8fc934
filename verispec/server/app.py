"""The FastAPI app: OpenAI-compatible endpoints over one loaded model, /metrics, and the live page.

    POST /v1/chat/completions, POST /v1/completions   (stream: true -> server-sent events)
    GET  /v1/models, /v1/models/{id}, /health, /metrics, /verispec/info, /openapi.json, /
    POST /v1/verispec/race                            (extension: several methods, same prompt)

Every request builds its own Engine with verispec.api.build_engine (cheap: the target model is loaded
once; an engine holds a pooled runner, i.e. a KV cache over the shared weights, and a small drafter),
waits in the fair FIFO queue of scheduler.Scheduler, and joins an engine thread's batch between two
steps: up to max_batch generations share one target forward per step (continuous batching). Speculation settings come from the server's defaults,
overridden per request by the extension object "verispec" in the body; statistics go back in a
"verispec" field of every response and stream chunk (OpenAI clients ignore unknown fields).

Modules: state.py (what the handlers share, as app.state.served), generate.py and info.py (the
handlers, as APIRouters), guard.py (the middleware below).

Hardening (what a hostile or careless client cannot do): the Host header must name an allowed host
(DNS rebinding cannot reach a loopback server from a web page); with an API key, /v1 and /metrics
need it (/verispec/info stays open: the page reads it before a key is typed, and it holds the model
name, methods, defaults and limits, nothing more); every failure, an unexpected exception included,
ends as an OpenAI error object on a connection that stays usable; the prompt is limited well under
the context by default and its prefill is stopped between chunks by a timeout or a disconnect.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from verispec.errors import InvalidParameter
from verispec.options import SpeculationSettings
from verispec.server import errors, generate, info
from verispec.server.guard import Guard
from verispec.server.info import STATIC
from verispec.server.scheduler import Scheduler
from verispec.server.state import Served

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass
class ServerConfig:
    """Defaults and limits of a server. Limits are what a request may ask for at most."""

    model_name: str | None = None          # the id clients send as "model" (default: the model's name)
    # the default speculation settings (verispec.options), each request's "verispec" object overrides them;
    # the draft model is create_app's `draft`, so settings.models.draft stays None
    settings: SpeculationSettings = field(default_factory=SpeculationSettings)
    # shorthands folded into `settings` as the config is made (None: the settings' value); they read back
    # the settings' values after
    method: str | None = None
    draft_length: int | None = None
    adaptive: bool | None = None
    default_max_tokens: int = 256
    max_tokens: int = 2048
    # a prompt's prefill holds a worker for seconds on a CPU (docs/performance-notes.md), so the default
    # stays well under the context; None: the model's context length - 1
    max_prompt_tokens: int | None = 2048
    max_body_bytes: int = 1 << 20
    max_queue: int = 16
    timeout: float = 300.0                 # seconds from arrival to the last token, queue wait included
    api_key: str | None = None
    workers: int = 1                       # engine threads, each running its own batch
    # generations stepped together per engine thread (continuous batching, scheduler.py); 1: one at a
    # time. `verispec serve` defaults to 8
    max_batch: int = 1
    # verified positions per batch step across its sequences, so speculation shrinks as the batch grows:
    # "auto" (measured: batch.free_positions), a number, or None (each sequence drafts as alone)
    batch_positions: int | str | None = "auto"
    keep_runners: int = 2                  # idle runners kept per runner configuration (see work.RunnerPool)
    # Host header values answered (any port); "*" = any. Loopback names by default, so a web page cannot
    # reach a keyless local server through DNS rebinding
    allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS

    def __post_init__(self):
        self.settings = self.settings.replace(method=self.method, draft_length=self.draft_length,
                                              adaptive=self.adaptive)
        self.method, self.draft_length, self.adaptive = (self.settings.method, self.settings.draft_length,
                                                         self.settings.adaptive)
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise InvalidParameter(f"max_batch must be an integer >= 1, got {self.max_batch!r}")
        p = self.batch_positions
        if p is not None and p != "auto" and (isinstance(p, bool) or not isinstance(p, int) or p < 1):
            raise InvalidParameter(f"batch_positions must be 'auto', an integer >= 1 or None, got {p!r}")


def create_app(target, config: ServerConfig | None = None, draft=None,
               engine_factory: Callable[..., Any] | None = None) -> FastAPI:
    """An app serving `target` (a verispec LoadedModel).

    draft: a LoadedModel for method "draft" (loaded once by the caller).
    engine_factory(target, draft=..., runner=..., **options) -> Engine, options by the flat names of
    verispec.options.SpeculationSettings: defaults to verispec.api.build_engine; tests wrap it.
    """
    config = config or ServerConfig()
    served = Served(target, config, draft, engine_factory)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        served.scheduler = app.state.scheduler = Scheduler(config.max_queue, config.workers, served.metrics,
                                                           max_batch=config.max_batch, positions=served.step_positions)
        try:
            yield
        finally:
            served.scheduler.close()

    # /openapi.json describes the API for clients' tools (and the fuzz test); no docs pages are served
    app = FastAPI(title="verispec", summary="OpenAI-compatible speculative decoding server", lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.served = served
    app.state.metrics = served.metrics
    app.state.config = config
    errors.install(app)
    app.add_middleware(Guard, config=config, metrics=served.metrics)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.include_router(generate.router)
    app.include_router(info.router)
    return app
