"""The server's state between start-up, requests and shutdown: loading -> ready -> draining (or failed)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from server.config import ServerConfig
from server.errors import unavailable
from server.metrics import Metrics
from server.request_stats import RequestTracking
from server.serving import Serving
from server.stats_log import StatsLog


@dataclass
class AppState:
    """Touched only on the event loop, except ``begin_drain``, which a signal handler may call (it only
    sets flags). ``on_fatal`` is told when loading or the engine loop fails, so the process can exit
    non-zero."""

    config: ServerConfig
    metrics: Metrics
    tracking: RequestTracking
    stats_log: StatsLog | None = None  # None: --log-stats-interval 0
    on_fatal: Callable[[BaseException], None] | None = None
    serving: Serving | None = None
    draining: bool = False
    failure: BaseException | None = None

    @classmethod
    def create(cls, config: ServerConfig, on_fatal: Callable[[BaseException], None] | None = None) -> AppState:
        metrics = Metrics(config.served_name)
        stats_log = StatsLog(config.log_stats_interval) if config.log_stats_interval > 0 else None
        log_requests = config.log_requests or config.log_request_text
        tracking = RequestTracking(metrics, log_requests=log_requests, log_text=config.log_request_text)
        return cls(config, metrics, tracking, stats_log, on_fatal)

    @property
    def status(self) -> str:
        if self.failure is not None:
            return "failed"
        if self.draining:
            return "shutting_down"
        return "ready" if self.serving is not None else "loading"

    def begin_drain(self) -> None:
        self.draining = True
        if self.serving is not None:
            self.serving.async_engine.stop_accepting()

    def fail(self, exc: BaseException) -> None:
        self.failure = exc
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def require_serving(self) -> Serving:
        """What a request needs of the engine, or the 503 that says why it is not there."""
        if self.failure is not None:
            raise unavailable("the engine has failed; the server is exiting")
        if self.draining:
            raise unavailable("the server is shutting down")
        if self.serving is None:
            raise unavailable("the model is still loading")
        return self.serving
