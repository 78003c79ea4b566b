"""Prometheus series, fed from the engine's StepStats in the worker thread (prometheus_client is thread-safe).

A minimal set; every series carries a ``model_name`` label. Prompt tokens count what prefill fed,
so a preempted request's recomputed prompt counts again (that work was really done).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from engine import RequestOutput, StepStats

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()  # one per app: no process-global state
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("specd:prompt_tokens", "Prompt tokens prefilled.", labels, registry=r)
        self.generation_tokens = Counter("specd:generation_tokens", "Tokens generated.", labels, registry=r)
        self.num_drafts = Counter(
            "specd:spec_decode_num_drafts", "Sequence-steps that verified at least one draft token.", labels, registry=r
        )
        self.draft_tokens = Counter(
            "specd:spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", labels, registry=r
        )
        self.accepted_tokens = Counter(
            "specd:spec_decode_num_accepted_tokens", "Draft tokens accepted by the target.", labels, registry=r
        )
        self.requests_finished = Counter(
            "specd:requests_finished", "Engine requests finished, by reason.", [*labels, "finished_reason"], registry=r
        )
        self.running = Gauge("specd:num_requests_running", "Requests in the running batch.", labels, registry=r)
        self.waiting = Gauge("specd:num_requests_waiting", "Requests waiting for a batch slot.", labels, registry=r)
        self.kv_usage = Gauge("specd:kv_cache_usage_perc", "Fraction of KV cache blocks in use.", labels, registry=r)
        name = model_name
        for metric in (self.prompt_tokens, self.generation_tokens, self.num_drafts, self.draft_tokens,
                       self.accepted_tokens, self.running, self.waiting, self.kv_usage):
            metric.labels(name)  # export zeros from the start, so rates work from the first scrape

    def observe_step(self, step: StepStats, outputs: list[RequestOutput]) -> None:
        name = self.model_name
        self.prompt_tokens.labels(name).inc(step.num_prompt_tokens)
        self.generation_tokens.labels(name).inc(step.num_generated_tokens)
        self.num_drafts.labels(name).inc(step.num_drafts)
        self.draft_tokens.labels(name).inc(step.num_draft_tokens)
        self.accepted_tokens.labels(name).inc(step.num_accepted_tokens)
        self.running.labels(name).set(step.num_running)
        self.waiting.labels(name).set(step.num_waiting)
        self.kv_usage.labels(name).set(step.kv_usage)
        for out in outputs:
            if out.finished and out.finish_reason:
                self.requests_finished.labels(name, out.finish_reason).inc()

    def observe_aborts(self, num_aborted: int, num_running: int, num_waiting: int, kv_usage: float) -> None:
        """Aborts happen between steps and produce no engine output, so they are reported apart."""
        name = self.model_name
        self.requests_finished.labels(name, "abort").inc(num_aborted)
        self.running.labels(name).set(num_running)
        self.waiting.labels(name).set(num_waiting)
        self.kv_usage.labels(name).set(kv_usage)

    def render(self) -> bytes:
        return generate_latest(self.registry)
