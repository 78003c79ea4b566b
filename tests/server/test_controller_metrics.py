"""The goodput controller over HTTP: its step-cost model and choices in /metrics, and a server it keeps on the
plain path doing no speculative work at all (draft forwards and verified drafts stay at 0)."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine
from tests.engine.lossless import flip_plain_and_speculative
from tests.server.test_metrics import GREEDY, Scrape, delta

pytestmark = pytest.mark.timeout(120)

IGNORE_EOS = {"ignore_eos": True}
PROMPTS = ([5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], "def fib(n):", "class Point:\n    def")


def adaptive_engine(ms) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(ms.target), draft_model=str(ms.draft), speculative_method="hybrid",
                                  dtype="float32", device="cpu"))


def send(live) -> None:
    client = live.client()
    for prompt in PROMPTS:
        client.completions.create(prompt=prompt, max_tokens=24, extra_body=IGNORE_EOS, **GREEDY)
    live.wait_idle()


def test_the_cost_model_and_the_choices_are_in_metrics(make_server, model_sets):
    engine = adaptive_engine(model_sets["llama"])
    modes = flip_plain_and_speculative(engine)  # every other step plain, the others speculating
    live = make_server(engine=engine, draft_model=str(model_sets["llama"].draft))
    first = Scrape.of(live)
    terms = first.by("specd:spec_controller_cost_seconds", "term")
    assert {"target_decode_1_tokens", "target_verify_2_tokens", "target_per_token_per_1k_context",
            "draft_model_per_forward", "host_per_sequence"} <= set(terms)
    assert terms["target_decode_1_tokens"] > 0, "profiled at start-up"
    assert first.by("specd:spec_controller_steps_total", "decision") == dict.fromkeys(
        ("plain", "probe", "speculate"), 0.0)
    send(live)
    after = Scrape.of(live)
    chose = {d: delta(first, after, "specd:spec_controller_steps_total", decision=d) for d in modes}
    assert chose == {d: float(n) for d, n in modes.items()} and chose.get("speculate", 0) > 0
    assert delta(first, after, "specd:spec_decode_num_draft_forwards_total") > 0
    assert after.value("specd:spec_controller_predicted_speedup") >= 1.0


def test_a_server_kept_on_the_plain_path_runs_no_draft_forward_and_verifies_no_draft(make_server, model_sets):
    engine = adaptive_engine(model_sets["llama"])
    engine.controller.margin = float("inf")  # no plan is ever good enough: every step is the plain one
    # The spacing the budget gives depends on this host's timings (tests/engine/speculative/test_controller.py
    # pins it with a set cost); a floor of 4 steps makes the count this test can hold to the same everywhere.
    engine.controller.probe_interval = 4
    live = make_server(engine=engine, draft_model=str(model_sets["llama"].draft))
    first = Scrape.of(live)
    send(live)
    after = Scrape.of(live)
    assert delta(first, after, "specd:spec_decode_num_draft_forwards_total") == 0
    assert delta(first, after, "specd:spec_decode_num_drafts_total") == 0
    assert delta(first, after, "specd:spec_decode_num_draft_tokens_total") == 0
    assert delta(first, after, "specd:spec_controller_steps_total", decision="speculate") == 0
    plain = delta(first, after, "specd:spec_controller_steps_total", decision="plain")
    probes = delta(first, after, "specd:spec_controller_steps_total", decision="probe")
    assert plain > 0 and 0 < probes <= (plain + probes) / 4 + 1, f"asked on {probes} of {plain + probes} steps"
