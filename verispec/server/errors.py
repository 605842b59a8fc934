"""OpenAI-style error responses: {"error": {"message", "type", "param", "code"}} with a 4xx status.

Every failure path of the server ends here, so a client always gets this shape with a message that
says what to change, and never a stack trace (unexpected exceptions are logged server-side and
answered with a generic 500).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec.errors import InvalidPrompt, ModelNotFound, VerispecError

log = logging.getLogger("verispec.server")


# line breaks as str.splitlines knows them, written as escapes: a message is one line
_LINE_BREAKS = str.maketrans({c: repr(c)[1:-1] for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"})


def _one_line(text: str) -> str:
    """A client's text echoed in a message: lone surrogates escaped (the body must encode as UTF-8), and
    line breaks, so the message stays one line whatever the client sent."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8").translate(_LINE_BREAKS)


class APIError(Exception):
    """An error to answer with: HTTP status, message, OpenAI error type, offending param, code."""

    expected = True  # raised on purpose for a bad request: no traceback in the server log

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        message, param = _one_line(message), None if param is None else _one_line(param)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers={**self.headers, **(headers or {})})


def internal_error() -> APIError:
    return APIError(500, "internal server error; the server log has the details", type="server_error",
                    code="internal_error")


def _first_problem(errors: list[dict]) -> dict:
    """The error to report. A union field (a prompt that is a string or a list of ids) reports one
    error per branch; a branch that took the value's type says what is wrong, a bare type mismatch
    says least."""
    first = errors[0] if errors else {}
    field = first.get("loc", ())[:2]
    same = [e for e in errors if e.get("loc", ())[:2] == field]
    telling = [e for e in same if not str(e.get("type", "")).endswith("_type") and e.get("type") != "literal_error"
               and e.get("type") != "union_tag_invalid"]
    if telling:
        return telling[0]
    if len(same) > 1:  # no branch of a union took the value: say what the field takes
        from verispec.options import SpeculationChoices

        loc = [p for p in first.get("loc", ()) if isinstance(p, str) and p.isidentifier()]
        spec = SpeculationChoices.model_fields.get(loc[-1]) if loc and loc[0] == "body" and len(loc) > 2 else None
        what = f"expected {spec.description}" if spec is not None and spec.description else "see /openapi.json"
        return {**first, "msg": f"wrong type ({what})"}
    return first


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = _first_problem(errors)
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return APIError(400, f"the request body is not valid JSON ({ctx.get('error', 'parse error')}); send a JSON object",
                        code="invalid_json")
    # union branches show in the location as type names ("list[int]"); keep field names and indices
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and (isinstance(p, int) or str(p).isidentifier())]
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid request"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if first.get("type") == "missing":
        message = f"the field '{param}' is required" if param else "the request body is missing; send a JSON object"
    elif first.get("type") in ("model_attributes_type", "dict_type") and not loc:
        message = "the request body must be a JSON object"
    elif first.get("type") == "extra_forbidden":
        message = f"unknown field '{param}'; leave it out"
    else:
        message = f"invalid value for '{param}': {msg}" if param else msg
    extra = len({tuple(e.get("loc", ())[:2]) for e in errors}) - 1  # fields, not union branches
    if extra > 0:
        message += f" (and {extra} more problem{'s' if extra > 1 else ''})"
    return APIError(400, message, param=param, code="invalid_value" if first.get("type") != "missing" else "missing_field")


def verispec_error(exc: VerispecError, param: str | None = None) -> APIError:
    if isinstance(exc, ModelNotFound):
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, InvalidPrompt):
        return APIError(400, str(exc), param=param, code="invalid_prompt")
    return APIError(400, str(exc), param=param, code="invalid_value")


def install(app: FastAPI) -> None:
    """Register the handlers that turn every exception into an OpenAI error object."""

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            err = APIError(404, f"no such endpoint: {request.method} {request.url.path}; see /v1/models, "
                                "/v1/chat/completions, /v1/completions", code="not_found")
        elif exc.status_code == 405:
            err = APIError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")
        else:
            err = APIError(exc.status_code, str(exc.detail), code="http_error")
        return err.response(headers=getattr(exc, "headers", None))

    @app.exception_handler(VerispecError)
    async def _verispec(request: Request, exc: VerispecError):
        return verispec_error(exc).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):  # guard.Guard normally answers these first
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return internal_error().response()
