"""Watching for a client that leaves before its (non-streaming) response is ready."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


class ClientGoneError(Exception):
    """The client disconnected before the response was ready."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first: then cancel it (which aborts its engine
    requests) and raise ClientGoneError. A plain (non-streaming) route is not cancelled by the
    server when its client leaves, so it has to watch by itself."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watch.cancel()
        raise
    watch.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientGoneError()
    return task.result()


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
