"""`verispec serve`: the OpenAI-compatible HTTP server (verispec.server) under uvicorn."""

from __future__ import annotations

import os
from typing import Optional

import typer

from verispec.commands import err, fail, friendly
from verispec.commands.speculation import speculation_flags
from verispec.models.registry import WEIGHTS_HELP
from verispec.options import SpeculationSettings


@friendly
@speculation_flags
def serve(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Embedded default, model directory, .gguf file or hub id."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; the default is reachable from this machine only."),
    port: int = typer.Option(8000, "--port", "-p"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="VERISPEC_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' on /v1 (or set VERISPEC_API_KEY)."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16."),
    weights: str = typer.Option("auto", "--weights", help=WEIGHTS_HELP),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda or auto."),
    max_tokens: int = typer.Option(2048, "--max-tokens", help="Most tokens a request may ask for."),
    default_max_tokens: int = typer.Option(256, "--default-max-tokens", help="Tokens generated when a request gives no max_tokens."),
    max_prompt_tokens: int = typer.Option(2048, "--max-prompt-tokens",
                                          help="Longest prompt accepted, in tokens (capped at the context window). "
                                               "The default 2048 is well under the embedded models' 8192: a prompt's "
                                               "prefill holds a worker, stopped only between chunks of 256 tokens."),
    max_body_bytes: int = typer.Option(1 << 20, "--max-body-bytes", help="Largest request body accepted."),
    max_queue: int = typer.Option(16, "--max-queue", help="Requests that may wait for the engine; more get 429."),
    timeout: float = typer.Option(300.0, "--timeout", help="Seconds a request may take, queue wait included."),
    workers: int = typer.Option(1, "--workers", help="Engine threads sharing the model, each running its own batch."),
    max_batch: int = typer.Option(8, "--max-batch", help="Generations an engine thread steps together (continuous "
                                                         "batching: requests join and leave between steps); 1: one at a time."),
    batch_positions: str = typer.Option("auto", "--batch-positions",
                                        help="Verified positions per batch step across its sequences, so speculation "
                                             "shrinks as the batch grows: 'auto' (the most one forward scores for about "
                                             "the cost of one, measured as the server starts), a number, or 'none'."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch CPU threads (default: torch's choice; 1 helps "
                                                                 "on a machine whose cores are busy with other work)."),
    allowed_host: list[str] = typer.Option([], "--allowed-host",
                                           help="A Host header value the server answers to (repeatable; '*' = any). "
                                                "Default: localhost, 127.0.0.1, ::1 and --host, so a web page cannot "
                                                "reach the server through DNS rebinding."),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level."),
    settings: SpeculationSettings = None,
):
    """Serve a model over an OpenAI-compatible HTTP API, with a live page at / showing the drafts. The
    speculation flags are the server's defaults; a request's "verispec" object overrides them."""
    import uvicorn

    from verispec.models import load_model
    from verispec.options import ModelSettings
    from verispec.server import ServerConfig, create_app

    draft = settings.models.draft
    if settings.method == "draft" and draft is None:
        fail("--method draft needs --draft MODEL")
    for label, value, low in (("--max-tokens", max_tokens, 1),
                              ("--default-max-tokens", default_max_tokens, 1), ("--max-body-bytes", max_body_bytes, 1),
                              ("--max-queue", max_queue, 0), ("--workers", workers, 1), ("--port", port, 0),
                              ("--max-batch", max_batch, 1),
                              ("--max-prompt-tokens", max_prompt_tokens, 1)):
        if value < low:
            fail(f"{label} must be >= {low}, got {value}")
    positions = batch_positions.strip().lower()
    if positions not in ("auto", "none"):
        if not positions.isdigit() or int(positions) < 1:
            fail(f"--batch-positions must be 'auto', 'none' or an integer >= 1, got {batch_positions!r}")
        positions = int(positions)
    if threads is not None and threads < 1:
        fail(f"--threads must be >= 1, got {threads}")
    if default_max_tokens > max_tokens:
        fail(f"--default-max-tokens ({default_max_tokens}) must not exceed --max-tokens ({max_tokens})")
    if timeout <= 0:
        fail(f"--timeout must be > 0, got {timeout}")
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        err.print(f"[yellow]warning:[/] binding {host} without --api-key: anyone who can reach this address can use the model")
    from verispec.server.app import LOOPBACK_HOSTS

    hosts = tuple(allowed_host) or LOOPBACK_HOSTS + (() if host in LOOPBACK_HOSTS + ("0.0.0.0", "::", "") else (host,))
    if host in ("0.0.0.0", "::") and not allowed_host:
        err.print(f"[yellow]note:[/] requests must name one of {', '.join(hosts)} in their Host header; add the names "
                  "clients use with --allowed-host NAME (or '*')")

    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    target = load_model(model, dtype=dtype, device=device, weights=weights)
    draft_model = load_model(draft, dtype=dtype, device=device) if draft is not None else None
    # the draft model is loaded once here and handed to the app; the settings keep the rest
    defaults = settings.model_copy(update={"models": ModelSettings(head=settings.models.head)})
    config = ServerConfig(settings=defaults, default_max_tokens=default_max_tokens,
                          max_tokens=max_tokens, max_prompt_tokens=max_prompt_tokens, max_body_bytes=max_body_bytes,
                          max_queue=max_queue, timeout=timeout, api_key=api_key, workers=workers, allowed_hosts=hosts,
                          max_batch=max_batch, batch_positions=None if positions == "none" else positions)
    server_app = create_app(target, config, draft=draft_model)
    err.print(f"serving {target.name} ({settings.method}) on http://{host}:{port}/  (OpenAI API under /v1, metrics at /metrics)")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    uvicorn.run(server_app, host=host, port=port, log_level=log_level)
