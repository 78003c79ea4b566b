"""Totals over engine steps (engine.StepTotals, the one definition of every mean and rate over steps): a
sliding time window (for the rate gauges) and plain running sums (for the periodic log line). Fed by the
engine's worker thread, read from the event loop, so both lock."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from engine import StepStats, StepTotals


class StepWindow:
    """The steps that ended in the last ``seconds``: totals kept incrementally (add on the way in,
    subtract on the way out), so a scrape costs O(steps that expired), not O(window)."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self._clock = clock
        self._steps: deque[tuple[float, StepStats]] = deque()
        self._totals = StepTotals()
        self._lock = threading.Lock()

    def add(self, step: StepStats) -> None:
        with self._lock:
            now = self._clock()
            self._steps.append((now, step))
            self._totals.add(step)
            self._expire(now)

    def _expire(self, now: float) -> None:
        while self._steps and self._steps[0][0] < now - self.seconds:
            self._totals.add(self._steps.popleft()[1], sign=-1)

    def totals(self) -> StepTotals:
        with self._lock:
            self._expire(self._clock())
            return self._totals.copy()

    def acceptance_rate_of(self, source: str) -> float:
        with self._lock:
            self._expire(self._clock())
            return self._totals.acceptance_rate_of(source)

    def tokens_per_second(self) -> float:
        """Generated tokens in the window over the window's length (so it ramps up and decays)."""
        return self.totals().num_generated_tokens / self.seconds


class StepAccumulator:
    """Running sums since the last ``take()`` (the periodic log line's interval)."""

    def __init__(self) -> None:
        self._totals = StepTotals()
        self._lock = threading.Lock()

    def add(self, step: StepStats) -> None:
        with self._lock:
            self._totals.add(step)

    def take(self) -> StepTotals:
        with self._lock:
            out, self._totals = self._totals, StepTotals()
            return out
