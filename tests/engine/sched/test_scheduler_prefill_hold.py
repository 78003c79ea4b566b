"""Prefill hold: a prompt arriving while the batch decodes waits a few steps for others, so that they are
prefilled in one chunk, but only where another is due soon and never past the hold or the group size."""

from __future__ import annotations

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.sched.block_manager import BlockManager
from engine.sched.scheduler import Scheduler
from engine.sched.stop import StopChecker
from engine.types.schedule import SchedulerConfig
from engine.types.sequence import FinishReason
from tests.device import GREEDY_ENGINE
from tests.engine.lossless import Reference, assert_equal_unless_near_tie, prompts_for
from tests.engine.sched.test_scheduler import apply_step, ids, make_seq, schedule

HOLD = 4  # steps; the arrival rate is counted over the last 8 holds, 32 steps, in steps that saw an arrival


def make_scheduler(hold=HOLD, group_tokens=64, budget=256):
    bm = BlockManager(num_blocks=512, block_size=4)
    config = SchedulerConfig(64, budget, 256, prefill_hold_steps=hold, prefill_group_tokens=group_tokens)
    return Scheduler(config, bm, StopChecker((), 256, None))


def decoding_batch(sched, n):
    """``n`` sequences arriving one a step, then stepped until all of them decode."""
    for i in range(n):
        sched.add(make_seq(f"d{i}", 3))
        apply_step(schedule(sched, {}))
    while sched.waiting or not all(s.is_decoding for s in sched.running):
        apply_step(schedule(sched, {}))
    assert ids(sched.running) == [f"d{i}" for i in range(n)]


def test_a_burst_is_admitted_at_once_and_counts_as_one_arrival():
    sched = make_scheduler()
    for i in range(12):
        sched.add(make_seq(f"d{i}", 3))
    out = schedule(sched, {})
    assert len(admitted(out)) == 12  # nothing decodes yet: none waits
    apply_step(out)
    sched.add(make_seq("p", 5))  # two steps with arrivals in 32: none other due within the hold
    assert admitted(schedule(sched, {})) == ["p"]


def admitted(out):
    """The sequences prefilling this step."""
    return [s.seq.request_id for s in out.scheduled if not s.seq.is_decoding]


def test_under_a_steady_stream_a_prompt_waits_for_the_next_and_both_are_prefilled_in_one_step():
    sched = make_scheduler()
    decoding_batch(sched, 8)  # with p, 9 steps with an arrival in the window: one due every 4 steps
    sched.add(make_seq("p", 5))
    seen, held = [], []
    for step in range(1, 7):
        if step == 3:
            sched.add(make_seq("q", 5))
        out = schedule(sched, {})
        seen.append(admitted(out))
        held.append(out.held_prompts)
        apply_step(out)
    # p waits its 4 steps (q, arriving meanwhile, with it), then both join the same step.
    assert seen == [[], [], [], [], ["p", "q"], []]
    assert held == [1, 1, 2, 2, 0, 0]  # what specd:prefill_held_prompts counts


def test_at_a_low_arrival_rate_a_prompt_is_admitted_at_once():
    sched = make_scheduler()
    decoding_batch(sched, 6)  # with p, 7 steps with an arrival in 32: none other due within the hold
    sched.add(make_seq("p", 5))
    assert admitted(schedule(sched, {})) == ["p"]


def test_prefill_hold_steps_0_admits_every_prompt_at_once():
    sched = make_scheduler(hold=0)
    decoding_batch(sched, 8)
    sched.add(make_seq("p", 5))
    assert admitted(schedule(sched, {})) == ["p"]


def test_waiting_prompts_that_make_the_group_size_are_admitted_without_waiting_longer():
    sched = make_scheduler(group_tokens=64)
    decoding_batch(sched, 8)
    sched.add(make_seq("p", 20))
    out = schedule(sched, {})
    assert admitted(out) == []
    apply_step(out)
    sched.add(make_seq("q", 44))  # 20 + 44 tokens wait: a chunk worth prefilling
    assert admitted(schedule(sched, {})) == ["p", "q"]


def test_a_prompt_joins_at_once_a_step_that_already_carries_a_prompt_chunk():
    sched = make_scheduler(group_tokens=512, budget=40)
    decoding_batch(sched, 8)
    sched.add(make_seq("long", 40))
    for _ in range(HOLD):  # held like any other prompt
        out = schedule(sched, {})
        assert admitted(out) == []
        apply_step(out)
    out = schedule(sched, {})
    assert admitted(out) == ["long"] and not sched.running[-1].is_decoding  # its first chunk of 32 tokens
    apply_step(out)
    sched.add(make_seq("p", 5))
    out = schedule(sched, {})
    assert admitted(out) == ["long", "p"]  # the step is a prefill step anyway: p adds to its chunk


def test_a_held_prompt_can_be_aborted_and_the_next_one_waits_only_its_own_hold():
    sched = make_scheduler()
    decoding_batch(sched, 8)
    p = make_seq("p", 5)
    sched.add(p)
    for _ in range(2):
        out = schedule(sched, {})
        apply_step(out)
    sched.finish(p, FinishReason.ABORT)
    assert ids(sched.waiting) == []
    sched.add(make_seq("q", 5))
    seen = []
    for _ in range(HOLD + 1):
        out = schedule(sched, {})
        seen.append(admitted(out))
        apply_step(out)
    assert seen == [[], [], [], [], ["q"]]


def test_a_bad_hold_or_group_size_is_refused_naming_the_option():
    with pytest.raises(ValueError, match="prefill_hold_steps"):
        EngineConfig(model="m", prefill_hold_steps=-1)
    with pytest.raises(ValueError, match="prefill_group_tokens"):
        EngineConfig(model="m", prefill_group_tokens=0)


def test_a_steady_stream_holds_prompts_and_every_output_stays_the_target_s(model_sets, tokenizer_dir):
    """The engine keeps 10 requests in flight, each replaced by the next as it ends: prompts arrive one by one
    while the batch decodes, fast enough to be held. Held or not, every output is the target's own."""
    ms = model_sets["llama"]
    ref = Reference(ms.target)
    llm = LLM(str(ms.target), draft_model=str(ms.draft), speculative_method="draft_model", num_speculative_tokens=3,
              prefill_hold_steps=HOLD, **GREEDY_ENGINE)
    engine, prompts = llm.engine, prompts_for(tokenizer_dir)
    requests = [(prompts[i % len(prompts)], (8, 13, 21, 32)[i % 4]) for i in range(40)]
    pending, got, held = iter(enumerate(requests)), {}, 0

    def admit() -> None:
        nxt = next(pending, None)
        if nxt is not None:
            i, (prompt, max_new) = nxt
            params = SamplingParams(max_tokens=max_new, temperature=0.0)
            engine.add_prepared(str(i), engine.prepare(prompt, params), params)
            got[str(i)] = []

    for _ in range(10):
        admit()
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            if out.finished:
                admit()
        held += engine.last_step.num_held_prompts if engine.last_step else 0
    assert held > 0, "no prompt was ever held: the stream did not exercise the hold"
    for i, (prompt, max_new) in enumerate(requests):
        assert_equal_unless_near_tie(ref, prompt, got[str(i)], ref.greedy(prompt, max_new), f"request {i}")
