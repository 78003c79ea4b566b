"""The Prometheus series. Every series carries ``model_name``; the README's "Observability" section
documents each one, its window and its unit.

Two feeds (prometheus_client is thread-safe):
- the engine's worker thread, per step (``observe_step``, ``observe_aborts``, ``observe_scheduled``:
  the EngineObserver protocol): speculation counters, the accepted-length histogram, queue time,
  the running/waiting/KV gauges, and the sliding window behind the rate gauges;
- the event loop, per delivered delta (server.request_stats.RequestTracker): prompt and generation
  tokens, TTFT, inter-token latency, end-to-end latency, and how each request ended. Counting what
  was delivered is what makes generation_tokens_total equal the sum of usage.completion_tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from engine import GRAMMAR_SOURCE, AuditResult, LLMEngine, RequestOutput, StepStats
from server.controller_metrics import ControllerMetrics
from server.count_histogram import CountHistogram
from server.step_window import StepWindow

CONTENT_TYPE = CONTENT_TYPE_LATEST
WINDOW_SECONDS = 30.0  # the rate gauges cover the steps that ended in the last 30 s
SUCCESS_REASONS = ("stop", "length")
# client_disconnect: the client went away (or the handler stopped reading) before the request finished;
# abort: the server aborted it (SIGTERM drain deadline passed); error: the engine failed or refused it;
# timeout: it ran past --request-timeout.
FAILURE_REASONS = ("client_disconnect", "abort", "error", "timeout")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
GRAMMAR_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
MAX_ACCEPTED_LENGTH = 32  # k <= 31 (a lookup, --max-lookup-tokens): 1..32 tokens a verify step, one bucket each


def draft_methods(engine: LLMEngine) -> list[str]:
    """The draft sources ``engine`` speculates with, by name: the values of the ``method`` label."""
    drafting = engine.drafting
    if drafting is None:
        return []
    names = [s.name for s in (*drafting.drafters, *drafting.lookups)]
    if drafting.config.grammar_drafts:
        names.append(GRAMMAR_SOURCE)
    return names


@dataclass
class MethodSeries:
    """One draft source's speculation counters."""

    drafts: Counter
    draft_tokens: Counter
    accepted_tokens: Counter
    per_pos: list[Counter] = field(default_factory=list)


class Metrics:
    def __init__(
        self, model_name: str, window_seconds: float = WINDOW_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.registry = CollectorRegistry()  # one per app: no process-global state
        self.model_name = model_name
        self.window = StepWindow(window_seconds, clock)
        r, name, m = self.registry, model_name, ["model_name"]

        def counter(metric: str, doc: str) -> Counter:
            return Counter(metric, doc, m, registry=r).labels(name)  # created now: zeros from the first scrape

        def gauge(metric: str, doc: str) -> Gauge:
            return Gauge(metric, doc, m, registry=r).labels(name)

        def histogram(metric: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(metric, doc, m, buckets=buckets, registry=r).labels(name)

        # Speculation, from StepStats, by the draft source ("method") that proposed the tokens.
        by_method = [*m, "method"]
        self._drafts = Counter(
            "specd:spec_decode_num_drafts", "Sequence-steps that verified at least one draft, by the method that "
            "drafted first in them.", by_method, registry=r,
        )
        self._draft_tokens = Counter("specd:spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
                                     by_method, registry=r)
        self._accepted_tokens = Counter("specd:spec_decode_num_accepted_tokens", "Draft tokens the target accepted.",
                                        by_method, registry=r)
        self._per_pos_family = Counter(
            "specd:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0 = the first draft token), by the method that drafted it.",
            [*by_method, "position"], registry=r,
        )
        self._methods: dict[str, MethodSeries] = {}
        self.accepted_length = CountHistogram(
            "specd:spec_decode_accepted_length",
            "Tokens emitted per verify step (accepted drafts + 1), per sequence that drafted; not by method, "
            "since one step can verify a method's drafts and grammar-forced ones together.",
            name, MAX_ACCEPTED_LENGTH, r,
        )
        # Where step time goes: with these, speedup bounds and the engine's own share come from /metrics.
        self.steps = counter("specd:engine_steps", "Engine steps (one target forward each).")
        self.step_seconds = counter("specd:engine_step_seconds", "Wall time of engine steps, seconds.")
        self.prefill_seconds = counter("specd:prefill_step_seconds", "Of that, steps that fed prompt tokens, seconds.")
        self.target_seconds = counter("specd:target_forward_seconds", "Target forward passes within steps, seconds.")
        self.draft_seconds = counter("specd:draft_seconds", "Drafting (proposals, all draft forwards) within steps.")
        self.controller = ControllerMetrics(r, name)
        # Prefix caching: hits / queries is the fraction of admitted tokens whose K/V was reused.
        self.prefix_queries = counter("specd:prefix_cache_queries",
                                      "Tokens of admitted sequences looked up in the prefix cache (recomputes too).")
        self.prefix_hits = counter("specd:prefix_cache_hits", "Of those, tokens whose K/V the prefix cache held.")
        self.held = counter("specd:prefill_held_prompts", "Waiting prompts held a step for later ones.")
        # Structured output: requests, what their grammars cost, and the drafts they force for free.
        self.structured = counter("specd:structured_requests", "Requests (choices) queued with an output constraint.")
        self.grammar_compile = histogram("specd:grammar_compile_seconds",
                                         "Building a structured request's grammar matcher.", GRAMMAR_BUCKETS)
        self.grammar_seconds = counter("specd:grammar_seconds", "Computing grammar token masks within steps, seconds.")
        self.forced_drafts = counter("specd:grammar_forced_draft_tokens",
                                     "Draft tokens proposed because the grammar allowed nothing else.")
        self.forced_accepted = counter("specd:grammar_forced_accepted_tokens", "Of those, tokens the target accepted.")
        # Tokens and requests, from what the HTTP handlers delivered.
        self.prompt_tokens = counter("specd:prompt_tokens", "Prompt tokens of requests, counted once per request.")
        self.generation_tokens = counter("specd:generation_tokens", "Generated tokens delivered to requests.")
        audit = Counter(
            "specd:spec_decode_audit", "Finished greedy requests re-run without speculation (--audit-fraction): "
            "match, mismatch, or near_tie (diverged where the target's top-2 logits were within 1e-4).",
            [*m, "result"], registry=r,
        )
        self.audit = {r.value: audit.labels(name, r.value) for r in AuditResult}
        self._success_family = Counter(
            "specd:request_success", "Engine requests (choices) finished, by finish_reason.",
            [*m, "finish_reason"], registry=r,
        )
        self._success = {reason: self._success_family.labels(name, reason) for reason in SUCCESS_REASONS}
        failure = Counter(
            "specd:request_failure", f"Engine requests (choices) that did not finish, by reason: {FAILURE_REASONS}.",
            [*m, "reason"], registry=r,
        )
        self._failure = {reason: failure.labels(name, reason) for reason in FAILURE_REASONS}
        # State, as of the last step or abort.
        self.running = gauge("specd:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("specd:num_requests_waiting", "Requests waiting for a batch slot.")
        self.kv_usage = gauge("specd:kv_cache_usage_perc", "Fraction of KV cache blocks in use, 0..1 (1 = full).")
        # Rates over the sliding window, computed when scraped so that they fall to 0 when idle.
        seconds = f"the steps that ended in the last {window_seconds:g} s"
        window = self.window
        self._acceptance = Gauge(
            "specd:spec_decode_acceptance_rate",
            f"Accepted / drafted tokens of one method over {seconds}; 0 without its drafts.", by_method, registry=r,
        )
        windowed: list[tuple[str, str, Callable[[], float]]] = [
            ("specd:spec_decode_acceptance_rate_overall",
             f"Accepted / drafted tokens, all methods together, over {seconds}; 0 without drafts.",
             lambda: window.totals().acceptance_rate),
            ("specd:generation_tokens_per_second", f"Tokens generated in {seconds}, per second.",
             window.tokens_per_second),
            ("specd:spec_decode_num_speculative_tokens",
             f"Mean drafts per decoding sequence (the k being chosen) over {seconds}.", lambda: window.totals().mean_k),
        ]
        for metric, doc, value in windowed:
            gauge(metric, doc).set_function(value)
        # Latency, per engine request (choice).
        self.ttft = histogram(
            "specd:time_to_first_token_seconds", "Arrival to the first generated token reaching the handler.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "specd:inter_token_latency_seconds",
            "Gap between deltas divided by the tokens in the later one, observed once per token.", ITL_BUCKETS,
        )
        self.e2e = histogram("specd:e2e_request_latency_seconds", "Arrival to the last token, finished requests.",
                             E2E_BUCKETS)
        self.queue_time = histogram(
            "specd:request_queue_time_seconds", "Queued for the engine to the start of its first scheduled step.",
            QUEUE_BUCKETS,
        )

    def declare_suffix_cache(self, nodes: Callable[[], int]) -> None:
        """``specd:suffix_cache_nodes``, read from the engine at each scrape."""
        Gauge("specd:suffix_cache_nodes", "Nodes of suffix decoding's index over recent outputs (its memory: about "
              "65 bytes a node).", ["model_name"], registry=self.registry).labels(self.model_name).set_function(nodes)

    def declare_methods(self, methods: Iterable[str]) -> None:
        """Series at zero, from the first scrape, for the draft sources the engine was built with (before it
        starts: afterwards only its worker thread adds series); any other source gets its own on first use."""
        for method in methods:
            self._series(method)

    def _series(self, method: str) -> MethodSeries:
        series = self._methods.get(method)
        if series is None:
            name, window = self.model_name, self.window
            series = self._methods[method] = MethodSeries(
                self._drafts.labels(name, method), self._draft_tokens.labels(name, method),
                self._accepted_tokens.labels(name, method),
            )
            self._acceptance.labels(name, method).set_function(lambda: window.acceptance_rate_of(method))
        return series

    # ---- engine worker thread (EngineObserver) ----------------------------------------------------

    def observe_step(self, step: StepStats, outputs: list[RequestOutput]) -> None:
        self.window.add(step)
        self.steps.inc()
        self.step_seconds.inc(step.step_seconds)
        if step.num_prompt_tokens:  # a prompt's chunk, alone or beside decodes: time speculation cannot shorten
            self.prefill_seconds.inc(step.step_seconds)
        self.target_seconds.inc(step.target_seconds)
        self.draft_seconds.inc(step.draft_seconds)
        self.controller.observe_step(step)
        if step.num_draft_tokens:
            for source in step.by_source:
                series = self._series(source.name)
                series.drafts.inc(source.num_drafts)
                series.draft_tokens.inc(source.num_draft_tokens)
                series.accepted_tokens.inc(source.num_accepted_tokens)
                per_pos = series.per_pos
                for i, n in enumerate(source.accepted_per_position):
                    if i == len(per_pos):
                        per_pos.append(self._per_pos_family.labels(self.model_name, source.name, str(i)))
                    per_pos[i].inc(n)  # zeros too: a position drafted but never accepted exports 0
            self.accepted_length.observe_many(step.accepted_lengths)
        if step.grammar_compile_seconds:
            self.structured.inc(len(step.grammar_compile_seconds))
            for seconds in step.grammar_compile_seconds:
                self.grammar_compile.observe(seconds)
        if step.grammar_seconds:
            self.grammar_seconds.inc(step.grammar_seconds)
        if step.num_forced_draft_tokens:
            self.forced_drafts.inc(step.num_forced_draft_tokens)
            self.forced_accepted.inc(step.num_forced_accepted_tokens)
        if step.prefix_cache_queries:
            self.prefix_queries.inc(step.prefix_cache_queries)
            self.prefix_hits.inc(step.prefix_cache_hits)
        if step.num_held_prompts:
            self.held.inc(step.num_held_prompts)
        for result in step.audit_results:
            self.audit[result].inc()
        self.running.set(step.num_running)
        self.waiting.set(step.num_waiting)
        self.kv_usage.set(step.kv_usage)

    def observe_aborts(self, num_aborted: int, num_running: int, num_waiting: int, kv_usage: float) -> None:
        """Aborts happen between steps; how each request ended is counted where it was delivered."""
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(kv_usage)

    def observe_scheduled(self, queue_seconds: list[float]) -> None:
        for seconds in queue_seconds:
            self.queue_time.observe(seconds)

    # ---- event loop, per HTTP request ---------------------------------------------------------------

    def count_prompt_tokens(self, n: int) -> None:
        self.prompt_tokens.inc(n)

    def observe_delta(self, num_tokens: int, first_token_seconds: float | None, gap_seconds: float | None) -> None:
        """One delta of ``num_tokens`` delivered: the first (with TTFT) or a later one (with the gap
        since the previous delta, spread evenly over its tokens)."""
        self.generation_tokens.inc(num_tokens)
        if first_token_seconds is not None:
            self.ttft.observe(first_token_seconds)
        elif gap_seconds is not None:
            per_token = gap_seconds / num_tokens
            for _ in range(num_tokens):
                self.itl.observe(per_token)

    def observe_success(self, finish_reason: str, e2e_seconds: float) -> None:
        counter = self._success.get(finish_reason)
        if counter is None:  # a reason the engine added later: count it rather than drop it
            counter = self._success[finish_reason] = self._success_family.labels(self.model_name, finish_reason)
        counter.inc()
        self.e2e.observe(e2e_seconds)

    def observe_failure(self, reason: str, count: int = 1) -> None:
        self._failure[reason].inc(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
