"""Jobs another thread hands to the thread that steps the engine, run before its next step: work that times
forwards (the goodput controller's profile once the compiled forwards serve) must not share the cores with a
step's, and must not write the caches while a step reads them."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class BetweenSteps:
    def __init__(self) -> None:
        self._due: list[Callable[[], object]] = []
        self._lock = threading.Lock()
        # Set by a loop that sleeps while it has no request (server.async_engine): wakes it to run a job.
        self.wake: Callable[[], None] | None = None

    @property
    def pending(self) -> bool:
        """Whether a job is due or running."""
        return bool(self._due)

    def add(self, job: Callable[[], object]) -> None:
        """From any thread: ``job`` runs on the stepping thread before its next step."""
        with self._lock:
            self._due.append(job)
        if self.wake is not None:
            self.wake()

    def run(self) -> None:
        """On the stepping thread: every job due, in order. One that fails is logged (a profile that failed
        leaves the cost model it had) and the engine serves on."""
        while self._due:
            try:
                self._due[0]()
            except Exception:
                logger.exception("a job between steps failed")
            with self._lock:
                self._due.pop(0)  # once it ran: pending until then
