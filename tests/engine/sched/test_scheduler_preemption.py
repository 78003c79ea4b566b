"""Scheduler preemption: when a running sequence's next token has no slot, the newest running
sequence gives its blocks back and is recomputed later; drafts never cause it."""

from __future__ import annotations

from engine.types.sequence import FinishReason, SequenceStatus
from tests.engine.sched.test_scheduler import (
    apply_step,
    check_blocks_conserved,
    ids,
    make_scheduler,
    make_seq,
    plan,
    schedule,
)

# ---- preemption ---------------------------------------------------------------------------------


def test_newest_sequence_is_preempted_when_blocks_run_out():
    sched, bm = make_scheduler(num_blocks=2, block_size=4)
    a, b = make_seq("a", 4), make_seq("b", 4)
    sched.add(a)
    sched.add(b)
    apply_step(schedule(sched, {}))  # each holds one block; a and b have 5 tokens, 4 computed
    c = make_seq("c", 4)
    sched.add(c)
    b_tokens = list(b.token_ids)
    out = schedule(sched, {})  # a's 5th token needs a second block; none is free
    assert out.preempted == [b]
    assert plan(out) == [("a", 1, 0)]
    assert len(a.block_table) == 2
    assert b.block_table == []
    assert b.num_computed == 0 and b.draft_num_computed == 0
    assert b.num_preemptions == 1
    assert b.status is SequenceStatus.WAITING
    assert b.token_ids == b_tokens  # the generated token is kept and recomputed later
    assert ids(sched.waiting) == ["b", "c"]  # at the front, ahead of the newer request
    assert ids(sched.running) == ["a"]
    assert bm.num_free_blocks == 0
    check_blocks_conserved(sched, bm)


def test_preempted_sequence_is_readmitted_and_recomputes_all_its_tokens():
    sched, bm = make_scheduler(num_blocks=2, block_size=4)
    a, b = make_seq("a", 4), make_seq("b", 4)
    sched.add(a)
    sched.add(b)
    apply_step(schedule(sched, {}))
    sched.add(make_seq("c", 4))
    out = schedule(sched, {})
    assert out.preempted == [b]
    apply_step(out)
    sched.finish(a, FinishReason.LENGTH)
    out = schedule(sched, {})
    # b comes back first (prompt and generated token recomputed, then it samples again); c must wait
    # because b's 5 tokens took both blocks.
    assert plan(out) == [("b", 5, 0)]
    assert out.scheduled[0].samples
    assert out.preempted == []
    assert b.status is SequenceStatus.RUNNING
    assert ids(sched.running) == ["b"] and ids(sched.waiting) == ["c"]
    apply_step(out)
    assert b.num_computed == 5 and b.num_output_tokens == 2
    check_blocks_conserved(sched, bm)


def test_sequence_that_cannot_grow_and_is_newest_preempts_itself():
    sched, bm = make_scheduler(num_blocks=2, block_size=4)
    a, b = make_seq("a", 3), make_seq("b", 4)
    sched.add(a)
    sched.add(b)
    apply_step(schedule(sched, {}))  # a: 4 tokens (fits its block); b: 5 tokens, needs a second block
    out = schedule(sched, {})
    assert out.preempted == [b]
    assert plan(out) == [("a", 1, 0)]
    assert ids(sched.running) == ["a"]
    assert ids(sched.waiting) == ["b"]  # not readmitted: its 5 tokens need 2 blocks, 1 is free
    assert b.num_preemptions == 1
    check_blocks_conserved(sched, bm)


def test_middle_sequence_growing_preempts_only_the_newest():
    sched, bm = make_scheduler(num_blocks=3, block_size=4)
    a, b, c = make_seq("a", 3), make_seq("b", 4), make_seq("c", 4)
    for s in (a, b, c):
        sched.add(s)
    apply_step(schedule(sched, {}))  # one block each, none free
    a_table = list(a.block_table)
    out = schedule(sched, {})  # a fits; b's 5th token needs a block: c (newest) gives way, not a
    assert out.preempted == [c]
    assert plan(out) == [("a", 1, 0), ("b", 1, 0)]
    assert a.block_table == a_table and a.num_preemptions == 0
    assert c.num_preemptions == 1 and ids(sched.waiting) == ["c"]
    check_blocks_conserved(sched, bm)


def test_drafts_shrink_to_free_slots_instead_of_preempting_anyone():
    sched, bm = make_scheduler(num_blocks=4, block_size=4)
    a, b, c = make_seq("a", 3), make_seq("b", 4), make_seq("c", 3)
    for s in (a, b, c):
        sched.add(s)
    apply_step(schedule(sched, {}))  # one block each, one free
    # b holds 4 slots and one block (4 slots) is free: after its 4 computed tokens and 1 new one,
    # 3 drafts fit. Asking for 8 must not evict c for optional work.
    out = schedule(sched, {"b": 8})
    assert out.preempted == []
    assert plan(out) == [("a", 1, 0), ("b", 1, 3), ("c", 1, 0)]
    check_blocks_conserved(sched, bm)


def test_preemption_cascades_newest_first_and_keeps_fifo_order():
    sched, bm = make_scheduler(num_blocks=3, block_size=2)
    a, b, c = make_seq("a", 2), make_seq("b", 2), make_seq("c", 2)
    for s in (a, b, c):
        sched.add(s)
    apply_step(schedule(sched, {}))  # one full block each, none free; each now has 3 tokens
    # Each decode needs a second block: a takes c's, then b can only preempt itself.
    out = schedule(sched, {})
    assert out.preempted == [c, b]
    assert plan(out) == [("a", 1, 0)]
    assert a.num_preemptions == 0 and a.status is SequenceStatus.RUNNING
    assert b.num_preemptions == 1 and c.num_preemptions == 1
    assert ids(sched.waiting) == ["b", "c"]
    check_blocks_conserved(sched, bm)


def test_waiting_sequences_never_preempt_running_ones():
    sched, bm = make_scheduler(num_blocks=2, block_size=4)
    a = make_seq("a", 6)
    sched.add(a)
    apply_step(schedule(sched, {}))  # a holds both blocks
    b = make_seq("b", 4)
    sched.add(b)
    table = list(a.block_table)
    out = schedule(sched, {})
    assert out.preempted == []
    assert plan(out) == [("a", 1, 0)]
    assert a.block_table == table and a.num_preemptions == 0
    assert ids(sched.waiting) == ["b"] and b.block_table == []


def test_blocked_head_of_the_waiting_queue_holds_back_later_requests():
    sched, _ = make_scheduler(num_blocks=3, block_size=4, budget=100)
    sched.add(make_seq("big", 16))  # needs 4 blocks at once
    sched.add(make_seq("small", 2))
    out = schedule(sched, {})
    assert out.scheduled == []
    assert ids(sched.waiting) == ["big", "small"]
