"""One HTTP request's engine requests (its n choices) and the one queue their deltas arrive on, read
on the event loop: leaving the reading early, closing the handle or passing its deadline aborts what
has not finished."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from typing import Protocol

from engine import RequestOutput, SamplingParams


class RequestTimeoutError(RuntimeError):
    """The request ran past --request-timeout; it has been aborted."""


class RequestFailedError(RuntimeError):
    """The engine failed this request alone (finish_reason "error"); the engine log says why."""


class RequestObserver(Protocol):
    """Told, on the event loop, about each delta one HTTP request receives and how its reading ended."""

    def on_output(self, out: RequestOutput) -> None: ...

    def on_end(self, unfinished: Collection[str], reason: str) -> None: ...


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]  # checked by LLMEngine.prepare on the event loop
    params: SamplingParams


class HandleOwner(Protocol):
    """What a handle needs of the engine it reads from (AsyncEngine): dropping its requests."""

    def abort(self, request_id: str) -> None: ...

    def forget(self, request_id: str) -> None: ...


class RequestHandle:
    """The engine requests of one HTTP request (its n choices), sharing one queue of deltas."""

    def __init__(
        self,
        owner: HandleOwner,
        request_ids: list[str],
        observer: RequestObserver | None = None,
        timeout: float | None = None,
    ) -> None:
        self._owner = owner
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.pending = set(request_ids)
        self._observer = observer
        self._closed = False
        self._failure = "client_disconnect"  # why pending requests end if reading stops early
        self._timer: asyncio.TimerHandle | None = None
        if timeout is not None:
            self._timer = asyncio.get_running_loop().call_later(timeout, self._expire, timeout)

    def _expire(self, timeout: float) -> None:
        if self._closed or not self.pending:
            return
        self._failure = "timeout"
        # Abort now rather than when the reader next looks: a stalled reader must not keep the blocks.
        for rid in self.pending:
            self._owner.abort(rid)
        self.queue.put_nowait(RequestTimeoutError(f"the request did not finish within {timeout:g} s"))

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Deltas as they come, until every request finished; leaving early aborts the rest. Raises
        RequestTimeoutError past the deadline, RequestFailedError when the engine failed a request."""
        try:
            while self.pending:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    if not isinstance(item, RequestTimeoutError):
                        self._failure = "error"
                    raise item
                if item.finished and item.finish_reason == "error":
                    self._failure = "error"
                    raise RequestFailedError("the engine failed this request")
                if self._observer is not None:
                    self._observer.on_output(item)
                if item.finished:
                    self.pending.discard(item.request_id)
                    self._owner.forget(item.request_id)
                yield item
        finally:
            self.close()

    def close(self) -> None:
        """Abort whatever has not finished (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        for rid in list(self.pending):
            self._owner.abort(rid)
        if self._observer is not None:
            self._observer.on_end(sorted(self.pending), self._failure)
        self.pending.clear()
