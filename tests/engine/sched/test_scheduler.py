"""Scheduler: FIFO continuous batching under a token budget and a KV block budget.

Steps are simulated by hand, the way LLMEngine.step applies them: a chunk that does not reach the
end of the known tokens only advances ``num_computed``; a step that samples appends the emitted
tokens and leaves exactly the last token without K/V."""

from __future__ import annotations

import random
import zlib

from engine.sched.block_manager import BlockManager
from engine.sched.scheduler import Scheduler
from engine.sched.stop import StopChecker
from engine.types.sampling_params import SamplingParams
from engine.types.schedule import SchedulerConfig
from engine.types.sequence import FinishReason, Sequence, SequenceStatus


def make_scheduler(max_num_seqs=8, budget=64, max_model_len=256, num_blocks=64, block_size=4):
    bm = BlockManager(num_blocks=num_blocks, block_size=block_size)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len), bm, StopChecker((), max_model_len, None)), bm


def schedule(sched, draft_lens, lags=None):
    """Set the drafts each sequence wants (and its source's catch-up) as Drafting.plan does, then schedule."""
    for seq in sched.running:
        seq.draft.k = draft_lens.get(seq.request_id, 0)
        seq.draft.lag = (lags or {}).get(seq.request_id, 0)
    return sched.schedule()


def make_seq(rid, prompt_len, max_tokens=64):
    """Prompts differ from the first token, so that the prefix cache shares nothing between them
    (tests/engine/core/test_prefix_caching.py is where it does)."""
    base = 10 + 1000 * (zlib.crc32(rid.encode()) % 1000)
    return Sequence(request_id=rid, token_ids=[base + i for i in range(prompt_len)], params=SamplingParams(max_tokens))


def apply_step(out, accepted=None):
    """Apply a scheduled step: prefill chunks advance; sampling sequences get 1 + accepted drafts tokens."""
    accepted = accepted or {}
    for s in out.scheduled:
        seq = s.seq
        if s.samples:
            n = 1 + min(accepted.get(seq.request_id, 0), s.num_draft_slots)
            seq.token_ids.extend([99] * n)
            seq.num_computed = seq.num_tokens - 1
        else:
            seq.num_computed += s.num_new_tokens


def ids(seqs):
    return [s.request_id for s in seqs]


def plan(out):
    return [(s.seq.request_id, s.num_new_tokens, s.num_draft_slots) for s in out.scheduled]


def check_blocks_conserved(sched, bm):
    held = [b for s in [*sched.running, *sched.waiting] for b in s.block_table]
    assert len(held) == len(set(held)), "a block is held twice"
    assert bm.num_free_blocks + len(held) == bm.num_blocks


# ---- admission ----------------------------------------------------------------------------------


def test_waiting_sequences_are_admitted_in_fifo_order_up_to_max_num_seqs():
    sched, _ = make_scheduler(max_num_seqs=2)
    a, b, c = make_seq("a", 3), make_seq("b", 3), make_seq("c", 3)
    for s in (a, b, c):
        sched.add(s)
    out = schedule(sched, {})
    assert plan(out) == [("a", 3, 0), ("b", 3, 0)]
    assert ids(sched.running) == ["a", "b"]
    assert ids(sched.waiting) == ["c"]
    assert a.status is SequenceStatus.RUNNING and c.status is SequenceStatus.WAITING
    apply_step(out)
    out = schedule(sched, {})
    assert ids(s.seq for s in out.scheduled) == ["a", "b"]  # c still waits: the batch is full
    apply_step(out)
    sched.finish(a, FinishReason.STOP)
    out = schedule(sched, {})
    assert plan(out) == [("b", 1, 0), ("c", 3, 0)]


def test_token_budget_chunks_the_prompt_that_crosses_it_and_stops_admission():
    sched, _ = make_scheduler(budget=10)
    a, b, c = make_seq("a", 6), make_seq("b", 8), make_seq("c", 2)
    for s in (a, b, c):
        sched.add(s)
    out = schedule(sched, {})
    assert plan(out) == [("a", 6, 0), ("b", 4, 0)]
    assert out.num_tokens == 10
    assert [s.samples for s in out.scheduled] == [True, False]
    assert ids(sched.waiting) == ["c"]
    apply_step(out)
    assert b.num_computed == 4
    out = schedule(sched, {})
    # Running first (a decodes, b finishes its prompt), then c joins with what is left.
    assert plan(out) == [("a", 1, 0), ("b", 4, 0), ("c", 2, 0)]
    assert all(s.samples for s in out.scheduled)


def test_long_prompt_is_prefilled_in_chunks_and_samples_only_on_the_last_chunk():
    sched, bm = make_scheduler(budget=10, block_size=4)
    seq = make_seq("long", 25)
    sched.add(seq)
    chunks = []
    for _ in range(4):
        out = schedule(sched, {})
        (s,) = out.scheduled
        chunks.append((s.num_new_tokens, s.samples, seq.num_computed))
        # Slots exist for everything fed this step.
        assert len(seq.block_table) * bm.block_size >= seq.num_computed + s.num_new_tokens
        apply_step(out)
    assert chunks == [(10, False, 0), (10, False, 10), (5, True, 20), (1, True, 25)]
    assert seq.num_tokens == 27 and seq.num_output_tokens == 2


def test_prefill_chunk_shares_the_budget_with_decoding_sequences():
    sched, _ = make_scheduler(budget=8)
    a = make_seq("a", 2)
    sched.add(a)
    apply_step(schedule(sched, {}))
    b = make_seq("b", 20)
    sched.add(b)
    out = schedule(sched, {"a": 3})
    assert plan(out) == [("a", 1, 3), ("b", 4, 0)]
    assert out.num_tokens == 8


# ---- drafts -------------------------------------------------------------------------------------


def test_decoding_sequence_gets_one_token_plus_its_drafts_with_slots_reserved():
    sched, bm = make_scheduler(block_size=4)
    seq = make_seq("a", 4)
    sched.add(seq)
    apply_step(schedule(sched, {}))
    assert seq.is_decoding
    out = schedule(sched, {"a": 3})
    assert plan(out) == [("a", 1, 3)]
    assert out.scheduled[0].samples
    assert out.num_tokens == 4
    assert len(seq.block_table) * bm.block_size >= seq.num_computed + 1 + 3


def test_decoding_sequence_without_a_draft_request_gets_no_drafts():
    sched, _ = make_scheduler()
    a, b = make_seq("a", 3), make_seq("b", 3)
    sched.add(a)
    sched.add(b)
    apply_step(schedule(sched, {}))
    out = schedule(sched, {"a": 2})
    assert plan(out) == [("a", 1, 2), ("b", 1, 0)]


def test_drafts_are_cut_to_the_remaining_token_budget():
    sched, _ = make_scheduler(budget=3)
    seq = make_seq("a", 2)
    sched.add(seq)
    apply_step(schedule(sched, {}))
    out = schedule(sched, {"a": 5})
    assert plan(out) == [("a", 1, 2)]


def test_drafts_are_capped_so_no_draft_goes_past_max_tokens():
    sched, _ = make_scheduler()
    seq = make_seq("a", 3, max_tokens=5)
    sched.add(seq)
    apply_step(schedule(sched, {}))
    assert seq.num_output_tokens == 1
    # 4 more tokens may be emitted: 3 drafts plus the bonus token.
    assert sched.max_useful_drafts(seq, 8) == 3
    out = schedule(sched, {"a": 8})
    assert plan(out) == [("a", 1, 3)]
    apply_step(out, accepted={"a": 1})
    assert seq.num_output_tokens == 3
    assert sched.max_useful_drafts(seq, 8) == 1
    seq.token_ids.append(99)
    assert sched.max_useful_drafts(seq, 8) == 0  # only the final token is left: no drafts
    assert sched.max_useful_drafts(seq, 0) == 0


def test_drafts_are_capped_so_the_bonus_token_still_fits_in_max_model_len():
    # The context holds 10 tokens. With n tokens, at most 10 - n more can be emitted, and a step with
    # d drafts emits up to d + 1 (the stop checker ends the sequence at 10): a draft beyond
    # 10 - n - 1 can only ever displace the bonus token, so computing it is wasted work.
    sched, _ = make_scheduler(max_model_len=10)
    caps = {n: sched.max_useful_drafts(make_seq("a", n, max_tokens=100), 8) for n in (1, 5, 7, 8, 9)}
    assert caps == {1: 8, 5: 4, 7: 2, 8: 1, 9: 0}


def test_requested_drafts_below_every_cap_are_granted_unchanged():
    sched, _ = make_scheduler(max_model_len=100)
    seq = make_seq("a", 5, max_tokens=50)
    assert sched.max_useful_drafts(seq, 4) == 4


# ---- finishing ----------------------------------------------------------------------------------


def test_finish_frees_every_block_of_a_running_sequence():
    sched, bm = make_scheduler(num_blocks=8, block_size=4)
    a, b = make_seq("a", 9), make_seq("b", 3)
    sched.add(a)
    sched.add(b)
    apply_step(schedule(sched, {}))
    out = schedule(sched, {"a": 4})
    apply_step(out)
    assert bm.num_free_blocks < 8
    sched.finish(a, FinishReason.STOP)
    assert a.block_table == [] and a.status is SequenceStatus.FINISHED and a.finish_reason is FinishReason.STOP
    assert ids(sched.running) == ["b"]
    sched.finish(b, FinishReason.LENGTH)
    assert bm.num_free_blocks == 8
    assert not sched.has_unfinished()


def test_finish_removes_a_waiting_sequence_and_a_preempted_one():
    sched, bm = make_scheduler(num_blocks=2, block_size=4)
    a, b = make_seq("a", 4), make_seq("b", 4)
    sched.add(a)
    sched.add(b)
    apply_step(schedule(sched, {}))
    c = make_seq("c", 4)
    sched.add(c)
    out = schedule(sched, {})
    assert out.preempted == [b]
    sched.finish(c, FinishReason.ABORT)
    sched.finish(b, FinishReason.ABORT)
    assert list(sched.waiting) == []
    assert b.status is SequenceStatus.FINISHED and b.finish_reason is FinishReason.ABORT
    assert c.status is SequenceStatus.FINISHED and c.finish_reason is FinishReason.ABORT
    assert ids(sched.running) == ["a"]
    sched.finish(a, FinishReason.ABORT)
    assert bm.num_free_blocks == 2
    # Nothing finished comes back.
    assert schedule(sched, {}).scheduled == []
    assert not sched.has_unfinished()


def test_random_workload_keeps_every_invariant_and_finishes_everything():
    rng = random.Random(1234)
    cfg = dict(max_num_seqs=4, budget=16, max_model_len=64, num_blocks=16, block_size=4)
    sched, bm = make_scheduler(**cfg)
    seqs = [make_seq(f"r{i}", rng.randint(1, 30), max_tokens=rng.randint(1, 20)) for i in range(12)]
    pending = list(seqs)
    preemptions = 0
    for _ in range(3000):
        if pending and rng.random() < 0.5:
            sched.add(pending.pop(0))
        if not sched.has_unfinished() and not pending:
            break
        lens = {s.request_id: rng.randint(0, 3) for s in sched.running if s.is_decoding}
        out = schedule(sched, lens)
        preemptions += len(out.preempted)
        assert out.num_tokens <= cfg["budget"]
        assert len(sched.running) <= cfg["max_num_seqs"]
        check_blocks_conserved(sched, bm)
        for s in sched.waiting:
            assert s.block_table == [] and s.num_computed == 0
        for s in out.scheduled:
            assert s.seq in sched.running
            assert s.num_new_tokens >= 1
            assert s.seq.num_computed + s.num_new_tokens <= s.seq.num_tokens
            assert len(s.seq.block_table) * bm.block_size >= s.seq.num_computed + s.num_new_tokens + s.num_draft_slots
            if s.num_draft_slots:
                assert s.seq.is_decoding
        apply_step(out, accepted={s.seq.request_id: rng.randint(0, s.num_draft_slots) for s in out.scheduled})
        for s in list(sched.running):
            if s.num_output_tokens >= s.params.max_tokens or s.num_tokens >= cfg["max_model_len"]:
                assert s.num_output_tokens <= s.params.max_tokens  # drafts never overshoot max_tokens
                sched.finish(s, FinishReason.LENGTH)
    assert not sched.has_unfinished() and not pending
    assert all(s.is_finished for s in seqs)
    assert bm.num_free_blocks == bm.num_blocks
    assert preemptions > 0  # the workload is tight enough to exercise preemption
