"""Server-sent events: ``data: {json}\\n\\n`` per chunk, ``data: [DONE]`` at the end."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from server.errors import APIError

DONE = "data: [DONE]\n\n"
# Valid raw in JSON and in SSE, but line breaks to str.splitlines, which some clients (httpx's
# aiter_lines among them) split event streams with: send them escaped, as JSON allows.
_LINE_BREAKS = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def event(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json().translate(_LINE_BREAKS)}\n\n"


def error_event(err: APIError) -> str:
    """An error after the stream began: the status line is long gone, so it travels as an event."""
    return f"data: {json.dumps(err.body())}\n\n"


def response(events: AsyncIterator[str], on_close: Callable[[], None]) -> StreamingResponse:
    # on_close also runs when the client left before the first event was produced (the generator's
    # own cleanup never runs if it never started).
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        background=BackgroundTask(on_close),
    )
