"""The server's outer layer (ASGI middleware): allowed hosts, the API key, the body size limit,
per-request metrics, and the last word on unexpected exceptions."""

from __future__ import annotations

import hmac
import logging
import time

from verispec.server import errors
from verispec.server.errors import APIError
from verispec.server.metrics import ServerMetrics

log = logging.getLogger("verispec.server")


def host_name(header: str) -> str:
    """The host of a Host header without its port: "[::1]:8000" -> "::1", "a.b:80" -> "a.b"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


class Guard:
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

    def __init__(self, app, config, metrics: ServerMetrics):
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
