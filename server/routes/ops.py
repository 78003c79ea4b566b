"""GET /health (readiness: 200 only when ready) and /metrics (Prometheus); both open, without the API key."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from server.metrics import CONTENT_TYPE
from server.routes.deps import State

router = APIRouter()


@router.get("/health")
async def health(state: State) -> JSONResponse:
    status = state.status
    body = {"status": status}
    if status == "ready" and state.serving is not None:
        # "compiling": serving already, its decode forwards still eager until then (--compile background)
        body["compile"] = state.serving.engine.compile_state
    return JSONResponse(body, status_code=200 if status == "ready" else 503)


@router.get("/metrics")
async def metrics(state: State) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
