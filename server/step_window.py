"""Totals over engine steps: a sliding time window (for the rate gauges) and plain running sums (for
the periodic log line). Fed by the engine's worker thread, read from the event loop, so both lock."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from engine import SourceStats, StepStats


@dataclass
class StepTotals:
    """Sums over a set of steps."""

    steps: int = 0
    prompt_tokens: int = 0  # prefill work, recomputation after preemption included
    generated_tokens: int = 0
    drafts: int = 0  # sequence-steps that verified at least one draft
    draft_tokens: int = 0
    accepted_tokens: int = 0
    preempted: int = 0
    decoding: int = 0  # decoding sequence-steps: the denominator of the mean k
    prefix_queries: int = 0  # admitted tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, found there
    by_source: dict[str, SourceStats] = field(default_factory=dict)  # the speculation sums, by draft source name

    def add(self, step: StepStats, sign: int = 1) -> None:
        self.steps += sign
        self.prompt_tokens += sign * step.num_prompt_tokens
        self.generated_tokens += sign * step.num_generated_tokens
        self.drafts += sign * step.num_drafts
        self.draft_tokens += sign * step.num_draft_tokens
        self.accepted_tokens += sign * step.num_accepted_tokens
        self.preempted += sign * step.num_preempted
        self.decoding += sign * step.num_decoding
        self.prefix_queries += sign * step.prefix_cache_queries
        self.prefix_hits += sign * step.prefix_cache_hits
        for source in step.by_source:
            self.by_source.setdefault(source.name, SourceStats()).add(source, sign)

    def copy(self) -> StepTotals:
        return replace(self, by_source={name: replace(s) for name, s in self.by_source.items()})

    def acceptance_rate_of(self, source: str) -> float:
        """One draft source's accepted / drafted tokens; 0 without drafts."""
        s = self.by_source.get(source)
        return s.acceptance_rate if s is not None else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens; 0 without drafts."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step (accepted drafts + 1); 0 without drafts."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0

    @property
    def mean_k(self) -> float:
        """Drafts per decoding sequence-step: the k the adaptive policy has been choosing."""
        return self.draft_tokens / self.decoding if self.decoding else 0.0


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
        return self.totals().generated_tokens / self.seconds


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
