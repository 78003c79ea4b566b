"""Per HTTP request, on the event loop: time each choice's deltas as the handler receives them, feed
the metrics, and (only with --log-requests) log one line when the request ends. The line carries ids,
token counts and timings; prompt and completion text only with --log-request-text."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from engine import RequestOutput
from server.metrics import Metrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestInfo:
    """What the handler knows when it submits."""

    request_id: str
    arrival: float  # time.monotonic() when the handler began
    num_prompt_tokens: int  # as usage.prompt_tokens counts them: once per prompt, not per choice
    prompt_text: Callable[[], str] | None = None  # called only with --log-request-text


@dataclass(frozen=True)
class RequestTracking:
    """How requests are observed: the metrics always, the log line by choice."""

    metrics: Metrics
    log_requests: bool = False
    log_text: bool = False

    def start(self, info: RequestInfo, engine_ids: list[str]) -> RequestTracker:
        return RequestTracker(info, engine_ids, self)


@dataclass
class _Choice:
    first: float | None = None  # when its first token arrived
    last: float | None = None
    tokens: int = 0
    outcome: str | None = None  # a finish_reason or a failure reason
    drafted: int = 0
    accepted: int = 0
    text: list[str] = field(default_factory=list)


class RequestTracker:
    """Implements server.async_engine.RequestObserver for one HTTP request (all its choices)."""

    def __init__(self, info: RequestInfo, engine_ids: list[str], tracking: RequestTracking) -> None:
        self.info = info
        self._tracking = tracking
        self._metrics = tracking.metrics
        self._choices = {rid: _Choice() for rid in engine_ids}
        self._prompt_counted = False

    def on_output(self, out: RequestOutput) -> None:
        now = time.monotonic()
        c = self._choices[out.request_id]
        n = len(out.new_token_ids)
        if n:
            if not self._prompt_counted:  # counted once the request has produced something
                self._prompt_counted = True
                self._metrics.count_prompt_tokens(self.info.num_prompt_tokens)
            if c.first is None:
                c.first = now
                self._metrics.observe_delta(n, now - self.info.arrival, None)
            else:
                assert c.last is not None
                self._metrics.observe_delta(n, None, now - c.last)
            c.last = now
            c.tokens += n
        # Cumulative counts; a synthetic abort output carries zeros.
        c.drafted = max(c.drafted, out.num_draft_tokens)
        c.accepted = max(c.accepted, out.num_accepted_tokens)
        if self._tracking.log_text:
            c.text.append(out.new_text)
        if out.finished:
            c.outcome = out.finish_reason or "stop"
            if c.outcome == "abort":  # only the server aborts a request that still has a reader
                self._metrics.observe_failure("abort")
            else:
                self._metrics.observe_success(c.outcome, now - self.info.arrival)

    def on_end(self, unfinished: Collection[str], reason: str) -> None:
        """The handler stopped reading; ``unfinished`` choices failed for ``reason``."""
        if unfinished:
            self._metrics.observe_failure(reason, len(unfinished))
            for rid in unfinished:
                self._choices[rid].outcome = reason
        if self._tracking.log_requests:
            logger.info("%s", self._line(time.monotonic()))

    def _line(self, now: float) -> str:
        info, choices = self.info, list(self._choices.values())
        firsts = [c.first for c in choices if c.first is not None]
        ttft = f"{min(firsts) - info.arrival:.3f} s" if firsts else "-"
        drafted, accepted = sum(c.drafted for c in choices), sum(c.accepted for c in choices)
        rate = f" ({accepted / drafted:.1%})" if drafted else ""
        line = (
            f"request {info.request_id}: {len(choices)} choice(s), prompt {info.num_prompt_tokens} tokens, "
            f"completion {sum(c.tokens for c in choices)} tokens, "
            f"finish {','.join(c.outcome or '-' for c in choices)}, ttft {ttft}, e2e {now - info.arrival:.3f} s, "
            f"drafted {drafted}, accepted {accepted}{rate}"
        )
        if self._tracking.log_text:
            prompt = info.prompt_text() if info.prompt_text is not None else ""
            line += f", prompt text {prompt!r}, completion text {[''.join(c.text) for c in choices]!r}"
        return line
