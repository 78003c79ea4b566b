"""The periodic log line: every ``interval`` seconds while the engine is busy, one INFO line on the
``server.stats_log`` logger, e.g.

    generation 182.3 tok/s, prefill 40.1 tok/s | running 4, waiting 0 | acceptance 71.3%,
        mean accepted length 3.14, k 3.90 | KV cache 12.5%          (one line in the log)

("acceptance -" when nothing was drafted; "acceptance 71.3% (draft_model 60.1%, ngram 82.0%)" when more than
one draft method drafted, each method's own rate; ", speculating in S% of steps" with adaptive k: the share of
steps the goodput controller chose to speculate in; ", preempted N" at the end when the scheduler preempted,
", prefix cache hits H%" when requests were admitted: the share of their tokens found cached).
Rates are over the interval since the previous line. Nothing is logged for an interval without steps.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from engine import RequestOutput, StepStats, StepTotals
from server.step_window import StepAccumulator

logger = logging.getLogger(__name__)


class StatsLog:
    """An EngineObserver (fed in the worker thread) plus the event-loop task that writes the line."""

    def __init__(self, interval: float) -> None:
        if interval <= 0:
            raise ValueError(f"the stats log interval must be positive, got {interval}")
        self.interval = interval
        self._totals = StepAccumulator()
        self._lock = threading.Lock()
        self._state = (0, 0, 0.0)  # running, waiting, KV usage: as of the last step or abort

    # ---- worker thread ----------------------------------------------------------------------------

    def observe_step(self, step: StepStats, outputs: list[RequestOutput]) -> None:
        self._totals.add(step)
        with self._lock:
            self._state = (step.num_running, step.num_waiting, step.kv_usage)

    def observe_aborts(self, num_aborted: int, num_running: int, num_waiting: int, kv_usage: float) -> None:
        with self._lock:
            self._state = (num_running, num_waiting, kv_usage)

    def observe_scheduled(self, queue_seconds: list[float]) -> None:
        pass

    # ---- event loop ---------------------------------------------------------------------------------

    async def run(self) -> None:
        """Log every ``interval`` seconds until cancelled."""
        since = time.monotonic()
        while True:
            await asyncio.sleep(self.interval)
            now = time.monotonic()
            self.log_once(now - since)
            since = now

    def log_once(self, elapsed: float) -> str | None:
        """Write the line for the last ``elapsed`` seconds, unless no step ran in them."""
        totals = self._totals.take()
        if totals.num_steps == 0:
            return None
        with self._lock:
            running, waiting, kv = self._state
        line = format_line(totals, elapsed, running, waiting, kv)
        logger.info("%s", line)
        return line


def format_line(t: StepTotals, elapsed: float, running: int, waiting: int, kv_usage: float) -> str:
    spec = "acceptance -"
    if t.num_draft_tokens:
        rates = [f"{name} {s.acceptance_rate:.1%}" for name, s in sorted(t.by_source.items()) if s.num_draft_tokens]
        split = f" ({', '.join(rates)})" if len(rates) > 1 else ""
        spec = f"acceptance {t.acceptance_rate:.1%}{split}, mean accepted length {t.mean_accepted_length:.2f}"
    preempted = f", preempted {t.num_preempted}" if t.num_preempted else ""
    if t.prefix_cache_queries:
        preempted += f", prefix cache hits {t.prefix_cache_hits / t.prefix_cache_queries:.1%}"
    steps = sum(t.speculation.values())
    if steps:  # the goodput controller's choices (adaptive k only)
        preempted = f", speculating in {t.speculation.get('speculate', 0) / steps:.0%} of steps" + preempted
    elapsed = max(elapsed, 1e-9)
    return (
        f"generation {t.num_generated_tokens / elapsed:.1f} tok/s, prefill {t.num_prompt_tokens / elapsed:.1f} tok/s | "
        f"running {running}, waiting {waiting} | {spec}, k {t.mean_k:.2f} | KV cache {kv_usage:.1%}{preempted}"
    )
