"""What the routes are given through FastAPI's dependencies: the app's state, and the API key check."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from server.errors import APIError
from server.state import AppState


def app_state(request: Request) -> AppState:
    return request.app.state.specd


State = Annotated[AppState, Depends(app_state)]


def check_key(request: Request, state: State) -> None:
    api_key = state.config.api_key
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
        raise APIError(401, "invalid or missing API key (send Authorization: Bearer KEY)", code="invalid_api_key")
