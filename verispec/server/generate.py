"""The generating endpoints: POST /v1/chat/completions and /v1/completions (OpenAI's shapes, stream: true ->
server-sent events) and the extension POST /v1/verispec/race (several methods on the same prompt)."""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from verispec.server.errors import APIError
from verispec.server.responses import respond, spec_stats, sse, step_ext, usage
from verispec.server.scheduler import Job
from verispec.server.schemas import ChatCompletionRequest, CompletionRequest, RaceRequest, SpeculationOptions
from verispec.server.state import ClientGone, Served, served
from verispec.server.work import run_race

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, s: Served = Depends(served)):
    s.check_model(body.model)
    s.check_supported(body)
    params = s.sampling(body.temperature, body.top_p, body.top_k, body.seed, body.limit(), body.stop)
    options = s.engine_options(body.verispec)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    ids = await s.encode("messages", chat=messages)
    job = s.submit(s.generation_work(options, ids, params), body.verispec)
    cid, now, name = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), s.name

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
    return await respond(s, request, job, body.stream, include, chunk, final,
                         opening=chunk(None, None, None, None, role=True))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, s: Served = Depends(served)):
    s.check_model(body.model)
    s.check_supported(body)
    params = s.sampling(body.temperature, body.top_p, body.top_k, body.seed, body.limit(), body.stop)
    options = s.engine_options(body.verispec)
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
    cid, now, name = f"cmpl-{uuid.uuid4().hex}", int(time.time()), s.name

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
    return await respond(s, request, job, body.stream, include, chunk, final)


@router.post("/v1/verispec/race")
async def race(body: RaceRequest, request: Request, s: Served = Depends(served)):
    if (body.messages is None) == (body.prompt is None):
        raise APIError(400, "give either 'messages' or 'prompt'", param="messages", code="invalid_value")
    params = s.sampling(0.0 if body.temperature is None else body.temperature, body.top_p, None, body.seed,
                        body.max_tokens, ())
    method = s.config.method
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
