"""Logs: a periodic stats line while busy and none when idle; request lines only when asked for, and
prompt or completion text only with --log-request-text."""

from __future__ import annotations

import logging
import re
import time

import pytest

from engine.types.stats import SourceStepStats
from server.cli import parse_config
from server.config import ConfigError
from server.stats_log import StatsLog
from tests.server.conftest import MODEL, slow_steps, tiny_engine
from tests.server.test_metrics import step_stats

pytestmark = pytest.mark.timeout(60)

LINE = re.compile(
    r"generation [\d.]+ tok/s, prefill [\d.]+ tok/s \| running \d+, waiting \d+ \| "
    r"(acceptance [\d.]+%( \([a-z_]+ [\d.]+%(, [a-z_]+ [\d.]+%)+\))?, mean accepted length [\d.]+|acceptance -), "
    r"k [\d.]+ \| KV cache [\d.]+%"
    r"(, prefix cache hits [\d.]+%)?"
)
SECRET = "def secret_prompt_text():"


def stats_lines(caplog, live) -> list[str]:
    """This server's lines (other live servers in the session log too, from their own threads)."""
    thread = live._thread.ident
    return [r.getMessage() for r in caplog.records if r.name == "server.stats_log" and r.thread == thread]


def test_stats_line_appears_every_interval_while_busy_and_never_when_idle(make_server, model_sets, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="server.stats_log")
    ms = model_sets["llama"]
    engine = tiny_engine(ms.target, ms.draft, k=4)
    live = make_server(engine=engine, draft_model=str(ms.draft), log_stats_interval=0.1)
    time.sleep(0.35)
    assert stats_lines(caplog, live) == [], "idle since start: nothing to report"
    slow_steps(monkeypatch, engine, 0.02)
    live.client().completions.create(
        model=MODEL, prompt="def fib(n):", max_tokens=80, temperature=0.0, extra_body={"ignore_eos": True}
    )
    busy = stats_lines(caplog, live)
    assert len(busy) >= 2, busy
    assert all(LINE.fullmatch(line) for line in busy), busy
    assert any("running 1," in line and "acceptance -" not in line for line in busy)
    time.sleep(0.25)  # the interval in which the request ended may still report once
    settled = len(stats_lines(caplog, live))
    time.sleep(0.5)
    assert len(stats_lines(caplog, live)) == settled, "idle: no more lines"


def test_stats_line_reports_the_interval_rates():
    log = StatsLog(10.0)
    assert log.log_once(10.0) is None, "no steps: no line"
    log.observe_step(step_stats(num_generated_tokens=30, num_prompt_tokens=10, num_draft_tokens=8,
                                num_accepted_tokens=6, num_drafts=2, num_decoding=2, mean_k=4.0, num_running=2,
                                kv_usage=0.125), [])
    line = log.log_once(2.0)
    assert line == (
        "generation 15.0 tok/s, prefill 5.0 tok/s | running 2, waiting 0 | acceptance 75.0%, "
        "mean accepted length 4.00, k 4.00 | KV cache 12.5%"
    )
    assert log.log_once(2.0) is None, "the totals restart after each line"
    log.observe_step(step_stats(num_prompt_tokens=16, prefix_cache_queries=64, prefix_cache_hits=48), [])
    assert log.log_once(1.0).endswith("| KV cache 25.0%, prefix cache hits 75.0%")


def test_stats_line_gives_each_methods_acceptance_only_when_more_than_one_drafted():
    log = StatsLog(10.0)
    two = (SourceStepStats("ngram", 1, 4, 4, (1, 1, 1, 1)), SourceStepStats("draft_model", 1, 4, 1, (1, 0, 0, 0)))
    log.observe_step(step_stats(num_drafts=2, num_draft_tokens=8, num_accepted_tokens=5, by_source=two), [])
    line = log.log_once(1.0)
    assert "| acceptance 62.5% (draft_model 25.0%, ngram 100.0%), mean accepted length 3.50, k " in line
    assert LINE.fullmatch(line)
    one = (SourceStepStats("draft_model", 1, 4, 2, (1, 1, 0, 0)), SourceStepStats("ngram", 0, 0, 0, ()))
    log.observe_step(step_stats(by_source=one), [])
    assert "| acceptance 50.0%, mean accepted length 3.00, k " in log.log_once(1.0), "one method drafted: no split"


def _request_records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "server.request_stats"]


def _complete(live) -> str:
    resp = live.client().completions.create(
        model=MODEL, prompt=SECRET, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True}
    )
    return resp.id


def test_request_logging_is_off_by_default(make_server, caplog):
    caplog.set_level(logging.DEBUG)
    rid = _complete(make_server())
    ours = [r.getMessage() for r in caplog.records if r.name.split(".")[0] in ("server", "engine", "uvicorn")]
    text = "\n".join(ours)  # (the openai client's own debug log does show the request body)
    assert rid not in text and SECRET not in text


def test_log_requests_gives_ids_lengths_and_timings_but_no_text(make_server, caplog):
    caplog.set_level(logging.INFO, logger="server.request_stats")
    rid = _complete(make_server(log_requests=True))
    [line] = _request_records(caplog)
    assert line.startswith(f"request {rid}: 1 choice(s), prompt ") and "completion 6 tokens" in line
    assert re.search(r"ttft [\d.]+ s, e2e [\d.]+ s", line) and "finish length" in line
    assert SECRET not in line


def test_log_request_text_adds_the_prompt_and_completion(make_server, caplog):
    caplog.set_level(logging.INFO, logger="server.request_stats")
    _complete(make_server(log_request_text=True))
    [line] = _request_records(caplog)
    assert f"prompt text {SECRET!r}" in line and ", completion text [" in line


def test_logging_flags_parse():
    config = parse_config(["serve", "--model", "org/m", "--log-stats-interval", "0", "--log-requests"])
    assert (config.log_stats_interval, config.log_requests, config.log_request_text) == (0, True, False)
    default = parse_config(["serve", "--model", "org/m"])
    assert (default.log_stats_interval, default.log_requests, default.log_request_text) == (10.0, False, False)
    with pytest.raises(ConfigError, match="log_stats_interval"):
        parse_config(["serve", "--model", "org/m", "--log-stats-interval", "-1"])
