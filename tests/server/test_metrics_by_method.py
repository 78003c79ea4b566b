"""Speculation split by draft method over HTTP: the method-labelled counters and acceptance gauges agree
with the per-method usage the responses reported, the series of the engine's methods exist at zero from
the first scrape, and usage carries the split (streamed too) or leaves it out when nothing was drafted."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine
from engine.types.stats import SourceStepStats
from server.metrics import Metrics, draft_methods
from tests.server.conftest import MODEL
from tests.server.test_metrics import GREEDY, Clock, Scrape, delta, step_stats
from tests.tiny_models import save_eagle_head

pytestmark = pytest.mark.timeout(120)

COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]}, "days": {"type": "integer"}, "rain": {"type": "boolean"},
    },
    "required": ["city", "days", "rain"],
    "additionalProperties": False,
}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
IGNORE_EOS = {"ignore_eos": True}


def split_of(usage) -> dict[str, dict[str, int]]:
    return usage.model_extra.get("spec_by_method") or {}


def test_method_counters_and_gauges_agree_with_the_per_method_usage_of_the_responses(make_server, model_sets):
    ms = model_sets["llama"]
    engine = LLMEngine(EngineConfig(model=str(ms.target), draft_model=str(ms.draft), speculative_method="hybrid",
                                    num_speculative_tokens=4, dtype="float32", device="cpu"))
    live = make_server(engine=engine, draft_model=str(ms.draft))
    methods = set(draft_methods(engine))
    assert methods == {"draft_model", "ngram", "suffix", "grammar"}
    first = Scrape.of(live)
    for counter in COUNTERS:
        assert first.by(f"specd:{counter}_total", "method") == dict.fromkeys(methods, 0.0), counter
    assert first.by("specd:spec_decode_acceptance_rate", "method") == dict.fromkeys(methods, 0.0)

    client, usages = live.client(), []
    usages.append(client.completions.create(prompt=[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], max_tokens=24,
                                            extra_body=IGNORE_EOS, **GREEDY).usage)
    usages.append(client.completions.create(prompt="def fib(n):", max_tokens=16, n=2, extra_body=IGNORE_EOS,
                                            **GREEDY).usage)
    stream = client.completions.create(prompt="weather:", max_tokens=60, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"response_format": JSON_FORMAT}, **GREEDY)
    usages.append([c for c in stream][-1].usage)
    # Again: where its own tokens match nothing yet, suffix decoding drafts the earlier requests' output.
    usages.append(client.completions.create(prompt="def fib(n):", max_tokens=16, extra_body=IGNORE_EOS,
                                            **GREEDY).usage)
    live.wait_idle()
    after = Scrape.of(live)
    assert after.value("specd:suffix_cache_nodes") > 0

    drafted = {m: sum(split_of(u).get(m, {}).get("draft_tokens", 0) for u in usages) for m in methods}
    accepted = {m: sum(split_of(u).get(m, {}).get("accepted_tokens", 0) for u in usages) for m in methods}
    assert all(drafted[m] > 0 for m in methods), f"every method drafted: {drafted}"
    for u in usages:
        assert sum(v["draft_tokens"] for v in split_of(u).values()) == u.model_extra["spec_draft_tokens"]
        assert sum(v["accepted_tokens"] for v in split_of(u).values()) == u.model_extra["spec_accepted_tokens"]
    for m in methods:
        assert delta(first, after, "specd:spec_decode_num_draft_tokens_total", method=m) == drafted[m], m
        assert delta(first, after, "specd:spec_decode_num_accepted_tokens_total", method=m) == accepted[m], m
        per_pos = delta(first, after, "specd:spec_decode_num_accepted_tokens_per_pos_total", method=m)
        assert per_pos == accepted[m], m
        # One private server, a few seconds old: its 30 s window holds every step the counters saw.
        assert after.value("specd:spec_decode_acceptance_rate", method=m) == pytest.approx(accepted[m] / drafted[m])
    assert after.value("specd:spec_decode_acceptance_rate_overall") == pytest.approx(
        sum(accepted.values()) / sum(drafted.values())
    )
    # Summed over the methods, the counters are the unlabelled totals they replaced.
    steps = delta(first, after, "specd:spec_decode_num_drafts_total")
    assert steps == delta(first, after, "specd:spec_decode_accepted_length_count")
    assert delta(first, after, "specd:spec_decode_num_draft_tokens_total") == sum(
        u.model_extra["spec_draft_tokens"] for u in usages
    )


@pytest.mark.parametrize("method", ["self", "eagle"])
def test_a_server_speculating_with_the_targets_own_states_counts_them_under_their_method(method, make_server,
                                                                                        model_sets, tmp_path):
    """"self": the target's first layer drafts; "eagle": an EAGLE-3 head reading its hidden states."""
    ms = model_sets["qwen2"]
    if method == "eagle":
        save_eagle_head(tmp_path, seed=1)
    engine = LLMEngine(EngineConfig(model=str(ms.target), draft_layers=1 if method == "self" else None,
                                    draft_model=str(tmp_path) if method == "eagle" else None,
                                    speculative_method=method, num_speculative_tokens=3, dtype="float32",
                                    device="cpu"))
    live = make_server(engine=engine)
    assert set(draft_methods(engine)) == {method, "grammar"}
    first = Scrape.of(live)
    usage = live.client().completions.create(prompt="def fib(n):", max_tokens=20, extra_body=IGNORE_EOS,
                                             **GREEDY).usage
    live.wait_idle()
    after = Scrape.of(live)
    extra = usage.model_extra
    assert extra["spec_draft_tokens"] > 0
    assert split_of(usage) == {method: {"draft_tokens": extra["spec_draft_tokens"],
                                        "accepted_tokens": extra["spec_accepted_tokens"]}}
    assert delta(first, after, "specd:spec_decode_num_draft_tokens_total", method=method) == \
        extra["spec_draft_tokens"]
    assert delta(first, after, "specd:spec_decode_num_accepted_tokens_total", method=method) == \
        extra["spec_accepted_tokens"]


def test_usage_splits_the_drafts_by_method_streamed_or_not_and_leaves_the_split_out_without_drafts(server):
    client = server.client()
    resp = client.completions.create(prompt="def fib(n):", max_tokens=12, n=2, extra_body=IGNORE_EOS, **GREEDY)
    extra = resp.usage.model_extra
    assert set(split_of(resp.usage)) == {"draft_model"}, "the shared server drafts with its draft model alone"
    assert split_of(resp.usage)["draft_model"] == {"draft_tokens": extra["spec_draft_tokens"],
                                                   "accepted_tokens": extra["spec_accepted_tokens"]}
    assert extra["spec_draft_tokens"] > 0
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c for c in stream][-1].usage
    assert split_of(usage)["draft_model"]["draft_tokens"] == usage.model_extra["spec_draft_tokens"] > 0
    off = server.post("/v1/completions", {"model": MODEL, "prompt": "x =", "max_tokens": 5,
                                          "num_speculative_tokens": 0}).json()["usage"]
    assert off["spec_draft_tokens"] == 0 and "spec_by_method" not in off


def test_each_method_has_its_own_counters_and_window_gauge_and_the_overall_rate_its_own_gauge():
    clock = Clock()
    m = Metrics("m", clock=clock)
    m.declare_methods(["draft_model", "ngram"])

    def scrape() -> Scrape:
        return Scrape(m.render().decode())

    assert scrape().by("specd:spec_decode_num_draft_tokens_total", "method") == {"draft_model": 0, "ngram": 0}
    # Sequence 1: three draft-model drafts, all accepted, then two the grammar forced, one accepted;
    # sequence 2: four lookup drafts, none accepted.
    by_source = (
        SourceStepStats("draft_model", 1, 3, 3, (1, 1, 1)),
        SourceStepStats("grammar", 0, 2, 1, (0, 0, 0, 1, 0)),
        SourceStepStats("ngram", 1, 4, 0, (0, 0, 0, 0)),
    )
    m.observe_step(step_stats(num_drafts=2, num_draft_tokens=9, num_accepted_tokens=4,
                              accepted_per_position=(1, 1, 1, 1, 0), accepted_lengths=(5, 1), by_source=by_source), [])
    s = scrape()
    assert s.by("specd:spec_decode_num_draft_tokens_total", "method") == {"draft_model": 3, "ngram": 4, "grammar": 2}
    assert s.by("specd:spec_decode_num_accepted_tokens_total", "method") == {"draft_model": 3, "ngram": 0, "grammar": 1}
    assert s.by("specd:spec_decode_num_drafts_total", "method") == {"draft_model": 1, "ngram": 1, "grammar": 0}
    assert s.by("specd:spec_decode_num_accepted_tokens_per_pos_total", "position") == {
        "0": 1, "1": 1, "2": 1, "3": 1, "4": 0}, "summed over the methods: the step's own per-position counts"
    assert s.value("specd:spec_decode_num_accepted_tokens_per_pos_total", method="grammar", position="3") == 1
    assert s.by("specd:spec_decode_acceptance_rate", "method") == {"draft_model": 1.0, "ngram": 0.0, "grammar": 0.5}
    assert s.value("specd:spec_decode_acceptance_rate_overall") == 4 / 9
    clock.now += 31  # the step left the window; the series stay, at 0
    s = scrape()
    assert s.by("specd:spec_decode_acceptance_rate", "method") == {"draft_model": 0.0, "ngram": 0.0, "grammar": 0.0}
    assert s.value("specd:spec_decode_acceptance_rate_overall") == 0.0
