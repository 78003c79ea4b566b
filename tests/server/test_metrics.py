"""/metrics tells the truth: token counters equal what the responses' usage says, the speculation
counters are consistent with each other, acceptance is ~1 for a draft identical to the target and ~0
for an unrelated one, the gauges fall back to 0 when idle, and engine/ knows nothing of Prometheus."""

from __future__ import annotations

import ast
import asyncio
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import SamplingParams, StepStats, StepTotals
from server.async_engine import AsyncEngine, EngineRequest
from server.metrics import Metrics
from server.request_stats import RequestInfo, RequestTracking
from server.stats_log import format_line
from server.step_window import StepAccumulator
from tests.server.conftest import MODEL, slow_steps, tiny_engine

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]
GREEDY = dict(model=MODEL, temperature=0.0)


class Scrape:
    """One parse of /metrics: samples by name, filtered by labels."""

    def __init__(self, text: str) -> None:
        self.samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]

    @classmethod
    def of(cls, live) -> Scrape:
        return cls(live.get("/metrics").text)

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples called ``name`` whose labels include ``labels``."""
        return sum(s.value for s in self.samples if s.name == name and labels.items() <= s.labels.items())

    def by(self, name: str, label: str) -> dict[str, float]:
        """Samples called ``name`` summed by the value of ``label``."""
        out: dict[str, float] = {}
        for s in self.samples:
            if s.name == name:
                out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
        return out


def delta(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)


def step_stats(**kw) -> StepStats:
    base = dict(
        num_scheduled=1, num_prompt_tokens=0, num_generated_tokens=3, num_drafts=1, num_draft_tokens=4,
        num_accepted_tokens=2, accepted_per_position=(1, 1, 0, 0), accepted_lengths=(3,), num_decoding=1, mean_k=4.0,
        num_preempted=0, num_running=1, num_waiting=0, kv_usage=0.25, draft_seconds=0.001,
        target_seconds=0.004, step_seconds=0.006,
    )
    return StepStats(**{**base, **kw})


# ---- against the shared live server (llama target, noisy draft, k = 4) ---------------------------------


def test_token_counters_equal_the_usage_returned_streamed_or_not_with_n_choices(server):
    client = server.client()
    server.wait_idle()
    before = Scrape.of(server)
    usages, choices = [], 0
    resp = client.completions.create(prompt="def fib(n):", max_tokens=9, n=3, extra_body={"ignore_eos": True}, **GREEDY)
    usages.append(resp.usage)
    choices += 3
    resp = client.completions.create(prompt=["for i in", "x ="], max_tokens=7, n=2, temperature=1.0, model=MODEL)
    usages.append(resp.usage)
    choices += 4
    stream = client.completions.create(
        prompt="class Point:", max_tokens=11, n=2, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}, **GREEDY,
    )
    usages.append([c for c in stream][-1].usage)
    choices += 2
    messages = [{"role": "user", "content": "hello"}]
    resp = client.chat.completions.create(messages=messages, max_tokens=6, n=2, **GREEDY)
    usages.append(resp.usage)
    choices += 2
    stream = client.chat.completions.create(
        messages=messages, max_tokens=8, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    usages.append([c for c in stream][-1].usage)
    choices += 1
    server.wait_idle()
    after = Scrape.of(server)

    completion = sum(u.completion_tokens for u in usages)
    assert delta(before, after, "specd:generation_tokens_total", model_name=MODEL) == completion
    assert delta(before, after, "specd:prompt_tokens_total", model_name=MODEL) == sum(u.prompt_tokens for u in usages)
    assert delta(before, after, "specd:request_success_total", model_name=MODEL) == choices
    assert delta(before, after, "specd:request_failure_total", model_name=MODEL) == 0
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(before, after, f"specd:{hist}_count", model_name=MODEL) == choices, hist
    # Per token: every token after each choice's first (a prefill step emits exactly one).
    assert delta(before, after, "specd:inter_token_latency_seconds_count", model_name=MODEL) == completion - choices
    ttft = delta(before, after, "specd:time_to_first_token_seconds_sum")
    e2e = delta(before, after, "specd:e2e_request_latency_seconds_sum")
    assert 0 < ttft < e2e
    # Each delta came out of one step, and each step's forwards happen inside it.
    steps = delta(before, after, "specd:engine_steps_total", model_name=MODEL)
    assert steps >= choices
    step_s = delta(before, after, "specd:engine_step_seconds_total", model_name=MODEL)
    target_s = delta(before, after, "specd:target_forward_seconds_total", model_name=MODEL)
    draft_s = delta(before, after, "specd:draft_seconds_total", model_name=MODEL)
    assert 0 < target_s and 0 < draft_s and target_s + draft_s <= step_s
    # Each choice's prompt was fed in a step of its own or beside others' decodes: some, never all, of the time.
    prefill_s = delta(before, after, "specd:prefill_step_seconds_total", model_name=MODEL)
    assert 0 < prefill_s < step_s


def test_speculation_counters_agree_with_each_other(server):
    # The server is the session's: other files' requests (other k among them) may have come before, so deltas.
    server.wait_idle()
    before = Scrape.of(server)
    client = server.client()
    client.completions.create(prompt="import os", max_tokens=40, extra_body={"ignore_eos": True}, **GREEDY)
    server.wait_idle()
    after = Scrape.of(server)
    drafts = delta(before, after, "specd:spec_decode_num_drafts_total", model_name=MODEL)
    drafted = delta(before, after, "specd:spec_decode_num_draft_tokens_total", model_name=MODEL)
    accepted = delta(before, after, "specd:spec_decode_num_accepted_tokens_total", model_name=MODEL)
    assert 0 < drafts <= drafted <= 4 * drafts, "k = 4"
    assert 0 <= accepted <= drafted
    name = "specd:spec_decode_num_accepted_tokens_per_pos_total"
    was, now = before.by(name, "position"), after.by(name, "position")
    counts = [now[str(i)] - was.get(str(i), 0.0) for i in range(len(now))]
    assert len(counts) >= 4 and not any(counts[4:]) and sum(counts) == accepted, counts
    assert counts == sorted(counts, reverse=True), "position i+1 is accepted only after position i"
    # One accepted-length observation per drafting sequence-step, each = accepted + 1.
    assert delta(before, after, "specd:spec_decode_accepted_length_count", model_name=MODEL) == drafts
    assert delta(before, after, "specd:spec_decode_accepted_length_sum", model_name=MODEL) == accepted + drafts


EXPORTED = [
    *(f"specd:{c}_total" for c in (
        "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
        "spec_decode_num_accepted_tokens_per_pos", "prompt_tokens", "generation_tokens", "request_success",
        "request_failure", "engine_steps", "engine_step_seconds", "prefill_step_seconds", "target_forward_seconds",
        "draft_seconds", "prefix_cache_queries", "prefix_cache_hits", "prefill_held_prompts", "structured_requests",
        "grammar_seconds", "grammar_forced_draft_tokens", "grammar_forced_accepted_tokens",
    )),
    *(f"specd:{g}" for g in (
        "spec_decode_acceptance_rate", "spec_decode_acceptance_rate_overall", "generation_tokens_per_second",
        "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "spec_decode_num_speculative_tokens",
    )),
    *(f"specd:{h}_{part}" for h in (
        "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
        "request_queue_time_seconds", "spec_decode_accepted_length", "grammar_compile_seconds",
    ) for part in ("bucket", "sum", "count")),
]


def test_every_series_is_exported_with_the_model_name(server):
    server.client().completions.create(prompt="a", max_tokens=5, **GREEDY)
    s = Scrape.of(server)
    assert set(EXPORTED) <= {x.name for x in s.samples}
    assert all(x.labels.get("model_name") == MODEL for x in s.samples if x.name.startswith("specd:"))
    assert set(s.by("specd:request_failure_total", "reason")) == {"client_disconnect", "abort", "error", "timeout"}


def test_running_and_kv_gauges_return_to_zero_after_requests_and_after_a_disconnect(server, monkeypatch):
    def gauges() -> tuple[float, float, float]:
        s = Scrape.of(server)
        return tuple(s.value(f"specd:{g}", model_name=MODEL) for g in ("num_requests_running",
                                                                       "num_requests_waiting", "kv_cache_usage_perc"))

    server.client().completions.create(prompt="def f():", max_tokens=12, **GREEDY)
    server.wait_until(lambda: gauges() == (0, 0, 0), 5, "the gauges to return to 0 after a request")
    slow_steps(monkeypatch, server.engine, 0.01)
    body = {"prompt": "def fib(n):", "max_tokens": 400, "stream": True, "ignore_eos": True, **GREEDY}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            while not next(lines).startswith("data:"):
                pass
            running, _, kv = gauges()
            assert running == 1 and kv > 0
    server.wait_until(lambda: gauges() == (0, 0, 0), 5, "the gauges to return to 0 after a disconnect")


# ---- private servers with other drafts ----------------------------------------------------------------


def _run_greedy(live, n_requests: int = 3, max_tokens: int = 40) -> None:
    client = live.client()
    for i in range(n_requests):
        client.completions.create(
            prompt=["def fib(n):", "for i in range(3):", "class A:"][i % 3], max_tokens=max_tokens,
            extra_body={"ignore_eos": True}, **GREEDY,
        )
    live.wait_idle()


def test_a_draft_identical_to_the_target_is_accepted_nearly_always(make_server, model_sets):
    target = model_sets["llama"].target
    live = make_server(engine=tiny_engine(target, target, k=4), draft_model=str(target))
    before = Scrape.of(live)
    _run_greedy(live)
    live.client().completions.create(
        prompt="x = 1", max_tokens=30, temperature=1.0, seed=3, model=MODEL, extra_body={"ignore_eos": True}
    )
    live.wait_idle()
    after = Scrape.of(live)
    drafted = delta(before, after, "specd:spec_decode_num_draft_tokens_total")
    accepted = delta(before, after, "specd:spec_decode_num_accepted_tokens_total")
    assert drafted > 50 and accepted / drafted > 0.95
    assert after.value("specd:spec_decode_acceptance_rate_overall", model_name=MODEL) > 0.95, "the 30 s window gauge"
    assert 2.0 < after.value("specd:spec_decode_num_speculative_tokens") <= 4.0
    assert after.value("specd:generation_tokens_per_second") > 0
    lengths = after.value("specd:spec_decode_accepted_length_sum")
    assert lengths / after.value("specd:spec_decode_accepted_length_count") > 3.5, "mean accepted length"


def test_an_unrelated_draft_is_rejected_or_switched_off_by_adaptive_k(make_server, model_sets):
    ms = model_sets["llama"]
    live = make_server(engine=tiny_engine(ms.target, ms.unrelated, k=None), draft_model=str(ms.unrelated))
    before = Scrape.of(live)
    _run_greedy(live)
    after = Scrape.of(live)
    drafted = delta(before, after, "specd:spec_decode_num_draft_tokens_total")
    accepted = delta(before, after, "specd:spec_decode_num_accepted_tokens_total")
    assert drafted == 0 or accepted / drafted < 0.2
    assert after.value("specd:spec_decode_acceptance_rate_overall") < 0.2
    assert after.value("specd:spec_decode_num_speculative_tokens") < 1.0, "adaptive k backs off"


def test_queue_time_counts_the_wait_for_a_batch_slot(make_server, model_sets, monkeypatch):
    engine = tiny_engine(model_sets["llama"].target, max_num_seqs=1)
    live = make_server(engine=engine)
    slow_steps(monkeypatch, engine, 0.02)

    async def two_at_once():
        async with live.async_client() as client:
            await asyncio.gather(*[
                client.completions.create(model=MODEL, prompt="a b", max_tokens=15, extra_body={"ignore_eos": True})
                for _ in range(2)
            ])

    asyncio.run(two_at_once())
    s = Scrape.of(live)
    assert s.value("specd:request_queue_time_seconds_count") == 2
    # One request waits for the other's 15 steps of >= 20 ms; the first is scheduled at once.
    queued = s.value("specd:request_queue_time_seconds_sum")
    assert queued > 0.25
    assert s.value("specd:time_to_first_token_seconds_sum") > queued


# ---- how requests end, through the worker-thread engine alone --------------------------------------------


def _failures_after(engine, stop) -> dict[str, float]:
    """Run one long request, let ``stop(async_engine)`` end it early, and return the failure counts."""
    metrics = Metrics("m")

    async def scenario():
        ae = AsyncEngine(engine, max_queue=4, observers=[metrics])
        ae.start()
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        tracker = RequestTracking(metrics).start(RequestInfo("r", time.monotonic(), 3), ["a"])
        handle = ae.submit([EngineRequest("a", [5, 6, 7], params)], tracker)

        async def read():
            async for _ in handle.outputs():
                pass

        reading = asyncio.ensure_future(read())
        await asyncio.sleep(0.1)
        await stop(ae)
        await asyncio.gather(reading, return_exceptions=True)
        await ae.shutdown(timeout=1)

    asyncio.run(scenario())
    s = Scrape(metrics.render().decode())
    assert s.value("specd:request_success_total") == 0
    return s.by("specd:request_failure_total", "reason")


def test_a_request_cut_off_by_the_drain_deadline_counts_as_abort(model_sets, monkeypatch):
    engine = tiny_engine(model_sets["llama"].target)
    slow_steps(monkeypatch, engine, 0.01)

    async def drain(ae):
        await ae.shutdown(timeout=0.05)

    assert _failures_after(engine, drain) == {"client_disconnect": 0, "abort": 1, "error": 0, "timeout": 0}


def test_a_request_in_a_crashed_engine_counts_as_error(model_sets, monkeypatch):
    engine = tiny_engine(model_sets["llama"].target)
    slow_steps(monkeypatch, engine, 0.01)

    def crashing_step():
        raise RuntimeError("injected crash")

    async def crash_it(ae):
        monkeypatch.setattr(engine, "step", crashing_step)
        await asyncio.sleep(0.1)  # the worker's next step raises; the reader gets EngineDeadError

    assert _failures_after(engine, crash_it) == {"client_disconnect": 0, "abort": 0, "error": 1, "timeout": 0}


# ---- the Metrics object alone -------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_window_gauges_cover_the_last_30_seconds_and_fall_to_zero_when_idle():
    clock = Clock()
    m = Metrics("m", clock=clock)

    def gauge(name: str) -> float:
        return Scrape(m.render().decode()).value(f"specd:{name}")

    m.observe_step(step_stats(num_draft_tokens=4, num_accepted_tokens=4, num_generated_tokens=5, mean_k=4.0), [])
    clock.now += 20
    m.observe_step(step_stats(num_draft_tokens=4, num_accepted_tokens=0, num_generated_tokens=1, num_decoding=3,
                              mean_k=4 / 3), [])
    assert gauge("spec_decode_acceptance_rate_overall") == 0.5
    assert gauge("generation_tokens_per_second") == pytest.approx(6 / 30)
    assert gauge("spec_decode_num_speculative_tokens") == 2.0  # 8 drafts over 4 decoding sequence-steps
    clock.now += 15  # the first step left the window
    assert gauge("spec_decode_acceptance_rate_overall") == 0.0
    assert gauge("generation_tokens_per_second") == pytest.approx(1 / 30)
    clock.now += 30
    assert [gauge(g) for g in ("spec_decode_acceptance_rate_overall", "generation_tokens_per_second",
                               "spec_decode_num_speculative_tokens")] == [0.0, 0.0, 0.0]


def test_mean_k_is_drafts_per_decoding_sequence_and_prefill_only_steps_do_not_count():
    m = Metrics("m", clock=Clock())
    m.observe_step(step_stats(num_decoding=1, num_draft_tokens=4, mean_k=4.0), [])
    m.observe_step(step_stats(num_prompt_tokens=50, num_generated_tokens=1, num_drafts=0, num_draft_tokens=0,
                              num_accepted_tokens=0, accepted_per_position=(), accepted_lengths=(),
                              num_decoding=0, mean_k=0.0), [])
    assert m.window.totals().mean_k == 4.0
    m.observe_step(step_stats(num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0, accepted_per_position=(),
                              accepted_lengths=(), num_decoding=3, mean_k=0.0), [])  # three chose k = 0
    assert m.window.totals().mean_k == 1.0


def test_accepted_length_histogram_has_one_cumulative_bucket_per_length():
    m = Metrics("m", clock=Clock())
    # 20: a lookup's long draft (past k_max), in its own bucket; 40 > 32: only in +Inf
    m.observe_step(step_stats(num_drafts=5, accepted_lengths=(3, 1, 5, 20, 40)), [])
    s = Scrape(m.render().decode())
    buckets = {x.labels["le"]: x.value for x in s.samples if x.name == "specd:spec_decode_accepted_length_bucket"}
    assert list(buckets) == [f"{n}.0" for n in range(1, 33)] + ["+Inf"]
    got = [buckets[le] for le in ("1.0", "2.0", "3.0", "4.0", "5.0", "19.0", "20.0", "32.0", "+Inf")]
    assert got == [1, 1, 2, 2, 3, 3, 4, 4, 5]
    assert s.value("specd:spec_decode_accepted_length_count") == 5
    assert s.value("specd:spec_decode_accepted_length_sum") == 69


def test_mean_accepted_length_with_no_drafts_is_the_same_in_log_and_metrics():
    m = Metrics("m", clock=Clock())
    log = StepAccumulator()  # what the stats log line sums over its interval
    engine = StepTotals()  # what LLM.stats() sums

    def feed(step: StepStats) -> tuple[StepTotals, float]:
        """(the log's interval totals, the accepted-length histogram's count) after one more step."""
        m.observe_step(step, [])
        log.add(step)
        engine.add(step)
        return log.take(), Scrape(m.render().decode()).value("specd:spec_decode_accepted_length_count")

    interval, count = feed(step_stats(num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0,
                                      accepted_per_position=(), accepted_lengths=(), num_decoding=2, mean_k=0.0))
    assert type(interval) is type(m.window.totals()) is StepTotals, "one totals class"
    assert interval.mean_accepted_length == m.window.totals().mean_accepted_length == engine.mean_accepted_length == 0
    assert count == 0, "no observations: the histogram has no mean either"
    assert "acceptance -," in format_line(interval, 1.0, 1, 0, 0.0), "the log shows no mean without drafts"
    interval, count = feed(step_stats(num_drafts=2, num_draft_tokens=8, num_accepted_tokens=5, accepted_lengths=(5, 2)))
    histogram_mean = Scrape(m.render().decode()).value("specd:spec_decode_accepted_length_sum") / count
    assert interval.mean_accepted_length == m.window.totals().mean_accepted_length == histogram_mean == 3.5
    assert engine.mean_accepted_length == 3.5
    assert "mean accepted length 3.50," in format_line(interval, 1.0, 1, 0, 0.0)


# ---- layering ------------------------------------------------------------------------------------------

FORBIDDEN = ("prometheus_client", "server", "fastapi", "starlette", "uvicorn")


def test_engine_never_imports_prometheus_or_the_server():
    for path in sorted((ROOT / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            bad = [n for n in names if n.split(".")[0] in FORBIDDEN]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
    code = (
        "import sys, engine; "
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}); "
        "assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_losslessness_audit_is_counted_by_result(make_server, model_sets):
    ms = model_sets["llama"]
    live = make_server(engine=tiny_engine(ms.target, ms.draft, k=4, audit_fraction=1.0), draft_model=str(ms.draft))
    live.client().completions.create(prompt="def fib(n):", max_tokens=20, **GREEDY)
    live.wait_until(lambda: Scrape.of(live).value("specd:spec_decode_audit_total", model_name=MODEL, result="match")
                    == 1, what="the audit of the one request")
    scrape = Scrape.of(live)
    assert set(scrape.by("specd:spec_decode_audit_total", "result")) == {"match", "mismatch", "near_tie"}
    assert scrape.value("specd:spec_decode_audit_total", model_name=MODEL, result="mismatch") == 0


def test_prompts_held_for_company_are_counted_once_a_step_each():
    m = Metrics("m")
    m.observe_step(step_stats(num_held_prompts=3), [])
    m.observe_step(step_stats(num_held_prompts=2), [])
    m.observe_step(step_stats(), [])
    assert Scrape(m.render().decode()).value("specd:prefill_held_prompts_total") == 5
