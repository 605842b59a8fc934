"""The generating endpoints: POST /v1/chat/completions and /v1/completions (OpenAI's shapes, stream: true ->
server-sent events) and the extension POST /v1/verispec/race (several methods on the same prompt), with
their response shapes and `respond`, which waits for a job and answers with one body or a stream."""

from __future__ import annotations

import json
import time
import uuid
from functools import partial
from typing import AsyncIterator, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from verispec.server.errors import APIError
from verispec.server.scheduler import Job
from verispec.server.schemas import ChatCompletionRequest, CompletionRequest, RaceRequest, SpeculationOptions
from verispec.server.state import ClientGone, Served, served
from verispec.server.work import run_race

router = APIRouter()


def _body(cid: str, created: int, model: str, obj: str, content: dict, finish, gen, ext, fingerprint=False) -> dict:
    """A response or stream chunk in OpenAI's shape: one choice, then usage and the "verispec" extension
    where given."""
    out = {"id": cid, "object": obj, "created": created, "model": model}
    if fingerprint:
        out["system_fingerprint"] = None
    out["choices"] = [{"index": 0, **content, "logprobs": None, "finish_reason": finish}]
    if gen is not None:
        out["usage"] = usage(gen)
    if ext is not None:
        out["verispec"] = ext
    return out


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


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, s: Served = Depends(served)):
    params, options = s.settings(body)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    ids = await s.encode("messages", chat=messages)
    job = s.submit(s.generation_work(options, ids, params), body.verispec)

    shape = partial(_body, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), s.name, fingerprint=True)

    def chunk(text, ext, finish, gen, role=False):
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
        return shape("chat.completion.chunk", {"delta": delta}, finish, gen, ext)

    def final(gen, job):
        message = {"role": "assistant", "content": gen.text}
        return shape("chat.completion", {"message": message}, gen.finish_reason, gen, spec_stats(gen, job))

    include = bool(body.stream_options and body.stream_options.include_usage)
    return await respond(s, request, job, body.stream, include, chunk, final,
                         opening=chunk(None, None, None, None, role=True))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, s: Served = Depends(served)):
    params, options = s.settings(body)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise APIError(400, "send one prompt per request (a string, or a list of one string)",
                           param="prompt", code="invalid_value")
        prompt = prompt[0]
    if isinstance(prompt, list):
        ids = await s.encode("prompt", ids=[int(i) for i in prompt])
    else:
        ids = await s.encode("prompt", prompt=prompt)
    job = s.submit(s.generation_work(options, ids, params), body.verispec)

    shape = partial(_body, f"cmpl-{uuid.uuid4().hex}", int(time.time()), s.name, "text_completion")

    def chunk(text, ext, finish, gen):
        return shape({"text": text or ""}, finish, gen, ext)

    def final(gen, job):
        return shape({"text": gen.text}, gen.finish_reason, gen, spec_stats(gen, job))

    include = bool(body.stream_options and body.stream_options.include_usage)
    return await respond(s, request, job, body.stream, include, chunk, final)


@router.post("/v1/verispec/race")
async def race(body: RaceRequest, request: Request, s: Served = Depends(served)):
    if (body.messages is None) == (body.prompt is None):
        raise APIError(400, "give either 'messages' or 'prompt'", param="messages", code="invalid_value")
    params = s.sampling(0.0 if body.temperature is None else body.temperature, body.top_p, None, body.seed,
                        body.max_tokens, ())
    method = s.config.settings.method
    lanes = body.lanes or [SpeculationOptions(method="ar"),
                           SpeculationOptions(method=method if method != "ar" else "ngram")]
    lane_options = [s.engine_options(lane, f"lanes.{i}") for i, lane in enumerate(lanes)]
    if body.messages is not None:
        ids = await s.encode("messages", chat=[{"role": m.role, "content": m.text()} for m in body.messages])
    else:
        ids = await s.encode("prompt", prompt=body.prompt)

    def race_work(job: Job) -> None:
        built = []
        try:
            for i, options in enumerate(lane_options):
                built.append(s.build(options, f"lanes.{i}"))
            job.emit("lanes", [engine.method for engine, _ in built])
            run_race(job, [engine for engine, _ in built], ids, params, s.target.decode, s.metrics)
        finally:
            for engine, key in built:
                s.pool.release(engine, key)

    # a plain job, not a batch member: the engine thread runs the whole race alone between two batch steps,
    # so each lane's clock times its own forwards (the batch's sequences wait meanwhile)
    job = s.submit(race_work, None)
    try:
        first = await s.next_item(job, request)
    except ClientGone:
        return Response(status_code=499)
    if first[0] == "error":
        raise first[1]
    if first[0] == "cancelled":
        raise s.cancelled_error(job, first[1])

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
                    err = s.cancelled_error(job, payload) if kind == "cancelled" else APIError(500, "internal server error")
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
