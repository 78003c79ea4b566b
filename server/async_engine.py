"""The engine behind an event loop: one worker thread owns the (synchronous, not thread-safe)
LLMEngine and runs its steps; the loop hands it adds and aborts and gets deltas back.

Requests join and leave the running batch between any two steps. Each HTTP request owns one
asyncio.Queue (server.request_handle) that receives the RequestOutput deltas of all its engine
requests (its n choices); the worker delivers a whole step's outputs with one ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from engine import LLMEngine, RequestOutput, StepStats
from server.request_handle import EngineRequest, RequestHandle, RequestObserver

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop crashed; nothing more can be served."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting for a batch slot."""


class NotAcceptingError(RuntimeError):
    """The engine is shutting down (or not started)."""


class EngineObserver(Protocol):
    """Told about every step, every batch of aborts, and the queue time of each request when its
    first step starts, in the worker thread (metrics and the stats log live here)."""

    def observe_step(self, step: StepStats, outputs: list[RequestOutput]) -> None: ...

    def observe_aborts(self, num_aborted: int, num_running: int, num_waiting: int, kv_usage: float) -> None: ...

    def observe_scheduled(self, queue_seconds: list[float]) -> None: ...


class AsyncEngine:
    """``submit`` queues requests and returns a RequestHandle; leaving its ``outputs()`` early
    (client gone, task cancelled) or closing it aborts what is left, which frees the KV blocks
    before the next step."""

    def __init__(
        self,
        engine: LLMEngine,
        max_queue: int,
        observers: Sequence[EngineObserver] = (),
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self._observers = list(observers)
        self._on_fatal = on_fatal
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handles: dict[str, RequestHandle] = {}  # request id -> its HTTP request (loop side)
        # Shared with the worker, guarded by _cond: commands not yet applied, and the engine's waiting count.
        self._cond = threading.Condition()
        self._adds: list[EngineRequest] = []
        self._queued_at: dict[str, float] = {}  # request id -> when submit() queued it, until the worker adds it
        self._aborts: list[str] = []
        self._num_waiting = 0
        self._stopping = False
        self._accepting = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # ---- lifecycle (event loop side) -------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="specd-engine", daemon=True)
        self.engine.between_steps.wake = self._wake  # a job handed to the engine by another thread
        self._thread.start()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    @property
    def is_running(self) -> bool:
        return self._accepting and self.error is None

    @property
    def num_in_flight(self) -> int:
        return len(self._handles)

    def stop_accepting(self) -> None:
        self._accepting = False

    async def shutdown(self, timeout: float) -> None:
        """Refuse new requests, give in-flight ones up to ``timeout`` seconds, abort the rest, stop the thread."""
        self._accepting = False
        deadline = asyncio.get_running_loop().time() + timeout
        while self._handles and self.error is None and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        for rid in list(self._handles):
            self._finish_aborted(rid)
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)

    # ---- requests (event loop side) -----------------------------------------------------------------

    def abort(self, request_id: str) -> None:
        """Forget the request now; the worker frees it in the engine before its next step."""
        if self._handles.pop(request_id, None) is None:
            return
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def forget(self, request_id: str) -> None:
        self._handles.pop(request_id, None)

    def submit(
        self, requests: list[EngineRequest], observer: RequestObserver | None = None, timeout: float | None = None
    ) -> RequestHandle:
        """Queue all of ``requests`` at once or none: raises QueueFullError, NotAcceptingError, EngineDeadError.
        With ``timeout`` (seconds), whatever has not finished by then is aborted."""
        if self.error is not None:
            raise EngineDeadError("the engine loop has stopped after an error")
        if not self._accepting:
            raise NotAcceptingError("the server is shutting down")
        with self._cond:
            waiting = self._num_waiting + len(self._adds)
            if waiting + len(requests) > self.max_queue:
                raise QueueFullError(f"{waiting} requests are waiting for a batch slot (max_queue {self.max_queue})")
            handle = RequestHandle(self, [r.request_id for r in requests], observer, timeout)
            now = time.monotonic()
            for r in requests:
                self._handles[r.request_id] = handle
                self._queued_at[r.request_id] = now
            self._adds.extend(requests)
            self._cond.notify()
        return handle

    def _finish_aborted(self, request_id: str) -> None:
        handle = self._handles.get(request_id)
        if handle is not None:
            handle.queue.put_nowait(RequestOutput(request_id, [], "", [], True, "abort", None, 0, 0, 0, 0, 0))
        self.abort(request_id)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            handle = self._handles.get(out.request_id)
            if handle is not None:  # None: aborted meanwhile, its consumer is gone
                handle.queue.put_nowait(out)

    def _reject(self, request_id: str, exc: BaseException) -> None:
        handle = self._handles.pop(request_id, None)
        if handle is not None:
            handle.queue.put_nowait(exc)

    def _fail_all(self, exc: BaseException) -> None:
        self.error = exc
        self._accepting = False
        handles = {id(h): h for h in self._handles.values()}
        self._handles.clear()
        for h in handles.values():
            h.queue.put_nowait(EngineDeadError("the engine loop has stopped after an error"))
        if self._on_fatal is not None:
            self._on_fatal(exc)

    # ---- the worker thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        last: StepStats | None = engine.last_step
        unscheduled: dict[str, float] = {}  # request id -> when it was queued, until its first step
        try:
            while True:
                with self._cond:
                    # Sleep while there is nothing to do: no busy loop when idle.
                    while not (self._adds or self._aborts or self._stopping or engine.has_work):
                        self._cond.wait()
                    if self._stopping:
                        break
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                    # Applied under the lock so a submitter never sees a request in neither count; adds
                    # first, so that a request aborted before the worker ever saw it is aborted, not run.
                    for r in adds:
                        queued_at = self._queued_at.pop(r.request_id, time.monotonic())
                        try:
                            engine.add_prepared(r.request_id, r.prompt_token_ids, r.params)
                        except Exception as exc:  # already validated by prepare(); fail the request, not the loop
                            logger.error("request %s refused by the engine: %s", r.request_id, exc)
                            self._post(self._reject, r.request_id, exc)
                            continue
                        unscheduled[r.request_id] = queued_at
                    num_aborted = sum(engine.abort(rid) for rid in aborts)
                    self._num_waiting = engine.num_waiting
                for rid in aborts:
                    unscheduled.pop(rid, None)
                if num_aborted:
                    usage = engine.block_manager.usage
                    for o in self._observers:
                        o.observe_aborts(num_aborted, engine.num_running, engine.num_waiting, usage)
                if not engine.has_work:
                    continue
                started = time.monotonic()
                outputs = engine.step()
                with self._cond:
                    self._num_waiting = engine.num_waiting
                # A step that scheduled nothing leaves last_step as it was.
                if engine.last_step is not None and engine.last_step is not last:
                    last = engine.last_step
                    queue_seconds = self._first_scheduled(unscheduled, started)
                    for o in self._observers:
                        o.observe_step(last, outputs)
                        if queue_seconds:
                            o.observe_scheduled(queue_seconds)
                if outputs:
                    self._post(self._deliver, outputs)
        except BaseException as exc:  # any failure here is fatal and must reach the loop
            logger.exception("engine loop crashed")
            self._post(self._fail_all, exc)
            return
        # Leave the engine clean for whoever uses it next (tests reuse one engine across servers).
        for rid in list(engine.seqs):
            engine.abort(rid)

    def _first_scheduled(self, unscheduled: dict[str, float], step_start: float) -> list[float]:
        """Queue times of the requests this step scheduled for the first time (they now have computed
        tokens, or finished within it), measured to the start of the step; forgets them."""
        seqs = self.engine.seqs
        done = [rid for rid in unscheduled if (seq := seqs.get(rid)) is None or seq.num_computed > 0]
        return [step_start - unscheduled.pop(rid) for rid in done]

    def _post(self, fn: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            logger.warning("event loop closed; dropped a message from the engine thread")
