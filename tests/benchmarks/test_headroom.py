"""benchmarks/headroom.py: the speedup bound with every cost but the drafted rows' matrix products at zero."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from benchmarks import headroom
from benchmarks.engine_bench.bound import expected


def test_a_tokens_forward_multiplies_every_projection_and_the_lm_head_once():
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=3, vocab_size=100)
    shapes = headroom.linear_shapes(config)
    # q, k, v (two KV heads of 16), o, gate, up, down per layer; the LM head last
    assert shapes[:7] == [(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)]
    assert len(shapes) == 3 * 7 + 1 and shapes[-1] == (64, 100)


def test_the_bound_at_the_floor_is_the_best_k_and_free_rows_reach_e_at_the_most_k():
    value, k = headroom.best_bound(0.8, 0.05)
    assert value == max(expected(0.8, j) / (1 + j * 0.05) for j in range(1, 17))
    assert value == pytest.approx(expected(0.8, k) / (1 + k * 0.05))
    assert headroom.best_bound(0.8, 0.0) == (expected(0.8, 16), 16)


def test_time_before_the_first_token_caps_the_whole_speedup():
    assert headroom.amdahl(0.0, 3.0) == pytest.approx(3.0)
    assert headroom.amdahl(0.25, 1e9) == pytest.approx(4.0)  # a free decode: only the first tokens remain
    assert headroom.amdahl(0.25, 3.0) == pytest.approx(2.0)


def test_the_acceptance_a_goal_needs_reaches_the_goal_and_no_less_does():
    need = headroom.alpha_needed(2.0, 0.05, 0.1)
    assert need is not None
    assert headroom.amdahl(0.1, headroom.best_bound(need, 0.05)[0]) == pytest.approx(2.0, abs=1e-6)
    assert headroom.amdahl(0.1, headroom.best_bound(need - 0.01, 0.05)[0]) < 2.0
    assert headroom.alpha_needed(5.0, 0.05, 0.25) is None  # p = 0.25 caps everything at 4x


def line(system: str, counters: dict, vs_none: float) -> dict:
    return {"set": "code", "concurrency": 2, "system": system, "counters": counters, "vs_none": vs_none}


def test_a_cell_takes_acceptance_from_the_default_and_the_decode_cost_from_no_speculation():
    default = line(headroom.DEFAULT, {"spec_decode_num_drafts": 10.0, "spec_decode_num_draft_tokens": 40.0,
                                      "spec_decode_num_accepted_tokens": 20.0}, 1.5)
    none = line(headroom.NONE, {"engine_step_seconds": 2.0, "generation_tokens": 400.0}, 1.0)
    # Two clients, 1 s a round; 0.4 s of waits for a first token over 2 client-seconds: p = 0.2.
    rounds = [{"round": r, "set": "code", "concurrency": 2, "system": headroom.NONE, "seconds": 1.0,
               "ttft_ms": [100.0, 100.0, 100.0, 100.0]} for r in (1, 2)]
    run = {"summary": [default, none], "rows": rounds}
    cell = headroom.cells([run])[("code", 2)]
    got = headroom.headroom(cell, floor_per_row=0.001, goal=2.0)
    assert got["prefill_share"] == pytest.approx(0.2) and got["prefill_share_from"] == "clients"
    assert got["mean_k"] == 4.0 and expected(got["alpha"], 4.0) == pytest.approx(3.0)
    assert got["plain_ms"] == pytest.approx(1e3 * 2.0 * 0.8 / 400)  # 4 ms a decode sequence-step
    assert got["c_floor"] == pytest.approx(0.25)
    assert got["bound_at_floor"] == pytest.approx(headroom.amdahl(0.2, headroom.best_bound(got["alpha"], 0.25)[0]))
    assert got["bound_all_free"] == pytest.approx(headroom.amdahl(0.2, expected(got["alpha"], 16)))


def test_a_later_run_replaces_an_earlier_ones_cell():
    def run(vs: float) -> dict:
        counters = {"spec_decode_num_drafts": 1.0, "spec_decode_num_draft_tokens": 1.0,
                    "spec_decode_num_accepted_tokens": 1.0}
        return {"summary": [line(headroom.DEFAULT, counters, vs), line(headroom.NONE, {}, 1.0)], "rows": []}

    assert headroom.cells([run(1.1), run(1.3)])[("code", 2)]["default"]["vs_none"] == 1.3


def test_the_engines_prefill_steps_give_the_share_less_a_decode_step_each_beside_other_sequences():
    default = line(headroom.DEFAULT, {"spec_decode_num_drafts": 10.0, "spec_decode_num_draft_tokens": 40.0,
                                      "spec_decode_num_accepted_tokens": 20.0}, 1.5)
    # 10 requests; 1 s of prompt steps; the other 1 s over 200 - 10 steps is 1/190 s a plain decode step.
    none = {**line(headroom.NONE, {"engine_step_seconds": 2.0, "prefill_step_seconds": 1.0, "engine_steps": 200.0,
                                   "generation_tokens": 400.0}, 1.0), "requests": 10}
    rounds = [{"round": 1, "set": "code", "concurrency": 2, "system": headroom.NONE, "seconds": 1.0,
               "ttft_ms": [100.0, 100.0]}]

    def share(conc: int) -> dict:
        cell = headroom.cells([{"summary": [{**default, "concurrency": conc}, {**none, "concurrency": conc}],
                                "rows": [{**r, "concurrency": conc} for r in rounds]}])[("code", conc)]
        return headroom.headroom(cell, 0.001, None)

    alone, beside = share(1), share(2)
    assert alone["prefill_share"] == 0.5 and alone["prefill_share_from"] == "engine"  # nothing else ran then
    assert beside["prefill_share"] == pytest.approx((1.0 - 10 / 190) / 2.0)
    assert beside["plain_ms"] == pytest.approx(1e3 * (2.0 - (1.0 - 10 / 190)) / 400)


def test_the_cost_a_goal_allows_reaches_the_goal_and_a_dearer_row_does_not():
    c = headroom.cost_allowed(2.0, 0.8, 0.1)
    assert c is not None and c > 0
    assert headroom.amdahl(0.1, headroom.best_bound(0.8, c)[0]) >= 2.0
    assert headroom.amdahl(0.1, headroom.best_bound(0.8, c * 1.01)[0]) < 2.0
    assert headroom.cost_allowed(3.0, 0.8, 0.3) is None  # E(0.8, 16) < 5: not even free rows


def test_a_drafted_tokens_measured_cost_is_the_summarys_c_times_the_plain_forward():
    none = {"concurrency": 1, "counters": {"engine_steps": 200.0, "target_forward_seconds": 0.8}}  # 4 ms a step
    assert headroom.row_cost_measured({"default": {"c": 0.375}, "none": none}) == pytest.approx(0.0015)
    assert headroom.row_cost_measured({"default": {}, "none": none}) is None  # above 1 the report gives no c
