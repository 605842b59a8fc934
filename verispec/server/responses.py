"""Response shapes shared by the generating endpoints: usage, the "verispec" statistics, server-sent
events, and `respond`, which waits for a job and answers with one JSON body or a stream of chunks."""

from __future__ import annotations

import json
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from verispec.server.errors import APIError
from verispec.server.scheduler import Job
from verispec.server.state import ClientGone, Served


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


async def respond(s: Served, request: Request, job: Job, stream: bool, include_usage: bool,
                  chunk: Callable[..., dict], final: Callable[..., dict], opening: dict | None = None) -> Response:
    """Wait for the job and answer: a JSON body from final(gen, job), or server-sent events: opening,
    then chunk(text, ext, finish, gen) per step and at the end."""
    try:
        if not stream:
            while True:
                kind, payload = await s.next_item(job, request)
                if kind == "done":
                    return JSONResponse(final(payload, job))
                if kind == "error":
                    raise payload
                if kind == "cancelled":
                    raise s.cancelled_error(job, payload)
        # wait for the first step before answering, so errors before it still get a real status
        kind, payload = await s.next_item(job, request)
    except ClientGone:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    if kind == "error":
        raise payload
    if kind == "cancelled":
        err = s.cancelled_error(job, payload)
        if isinstance(err, ClientGone):
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
                    err = s.cancelled_error(job, payload) if kind == "cancelled" else \
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
