"""The HTTP routes, one module per concern: ``inference`` (completions and chat), ``models``, ``tokenizer``
(vLLM's /tokenize, /detokenize and /tokenizer_info) and ``ops`` (health and metrics). They reach the app's
state through ``deps``."""

from __future__ import annotations

from fastapi import APIRouter, Depends, FastAPI

from server.routes import inference, models, ops, tokenizer
from server.routes.deps import check_key


def include(app: FastAPI) -> None:
    """/v1/* and the tokenizer's routes (at the root, where vLLM has them) behind the API key; /health and
    /metrics open, for probes and scrapers."""
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])
    v1.include_router(inference.router)
    v1.include_router(models.router)
    app.include_router(v1)
    app.include_router(tokenizer.router, dependencies=[Depends(check_key)])
    app.include_router(ops.router)
