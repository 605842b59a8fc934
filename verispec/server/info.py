"""The reading endpoints: GET /v1/models, /v1/models/{id}, /health, /metrics (Prometheus text),
/verispec/info (what the live page reads before a key is typed) and / (the live page)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Depends
from fastapi.responses import FileResponse, PlainTextResponse

from verispec.server.state import Served, served

STATIC = Path(__file__).parent / "static"

router = APIRouter()


@router.get("/v1/models")
async def list_models(s: Served = Depends(served)):
    return {"object": "list", "data": [{"id": s.name, "object": "model", "created": s.created, "owned_by": "verispec"}]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, s: Served = Depends(served)):
    s.check_model(model_id)
    return {"id": s.name, "object": "model", "created": s.created, "owned_by": "verispec"}


@router.get("/health")
async def health(s: Served = Depends(served)):
    return {"status": "ok", "model": s.name, "queued": s.scheduler.waiting if s.scheduler else 0}


@router.get("/metrics")
async def prometheus(s: Served = Depends(served)):
    return PlainTextResponse(s.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/verispec/info")
async def info(s: Served = Depends(served)):
    config, draft = s.config, s.draft
    return {"model": s.name, "methods": s.methods, "draft_model": draft.name if draft is not None else None,
            "defaults": {**config.settings.flat(wire=True), "max_tokens": config.default_max_tokens},
            "limits": {"max_tokens": config.max_tokens, "max_prompt_tokens": s.max_prompt,
                       "max_body_bytes": config.max_body_bytes, "max_queue": config.max_queue,
                       "timeout": config.timeout, "max_batch": config.max_batch},
            "api_key_required": bool(config.api_key)}


@router.get("/")
async def page():
    return FileResponse(STATIC / "index.html")
