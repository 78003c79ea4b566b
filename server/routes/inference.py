"""POST /v1/completions and /v1/chat/completions."""

from __future__ import annotations

from collections.abc import Awaitable

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.chat import create_chat_completion
from server.completions import create_completion
from server.disconnect import ClientGoneError
from server.errors import from_exception
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.routes.deps import State

router = APIRouter()


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request, state: State) -> Response:
    return await _guard(create_completion(body, request, state.require_serving()))


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: State) -> Response:
    return await _guard(create_chat_completion(body, request, state.require_serving()))


async def _guard(work: Awaitable[Response]) -> Response:
    """Map whatever a handler raises to an OpenAI error; unexpected errors are logged, never echoed."""
    try:
        return await work
    except ClientGoneError:
        return Response(status_code=499)  # nobody is listening; nginx's code for it
    except Exception as exc:
        raise from_exception(exc) from None
