"""GET /v1/models and /v1/models/{model}: the one model this server serves."""

from __future__ import annotations

from fastapi import APIRouter

from server.responses import ModelCard, ModelList
from server.routes.deps import State
from server.state import AppState

router = APIRouter()


@router.get("/models")
async def models(state: State) -> ModelList:
    return ModelList(data=[_card(state)])


@router.get("/models/{model:path}")
async def model(model: str, state: State) -> ModelCard:
    state.require_serving().check_model(model)
    return _card(state)


def _card(state: AppState) -> ModelCard:
    serving, config = state.require_serving(), state.config
    ec = serving.engine.config  # what the engine runs, whichever way it was built
    return ModelCard(
        id=config.served_name, root=config.target_path, max_model_len=serving.max_model_len,
        draft_model=ec.draft_model if ec.uses_draft_model else None, speculative_method=ec.speculative_method.value,
    )
