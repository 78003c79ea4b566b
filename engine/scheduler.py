"""Waiting -> running under a per-step token budget and the KV block budget. No torch."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # fed from token_ids[num_computed:]
    num_draft_slots: int  # capacity reserved for drafts; the drafter may fill fewer

    @property
    def samples(self) -> bool:
        """This step reaches the end of the sequence's known tokens, so it yields a token."""
        return self.seq.num_computed + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_draft_slots for s in self.scheduled)


class Scheduler:
    """FIFO continuous batching. Running sequences are served first (oldest first); waiting ones
    join while the token budget, ``max_num_seqs`` and free blocks allow. A long prompt is fed in
    chunks across steps (chunked prefill is the same operation as decode with more tokens). When
    blocks run out, the newest running sequence is preempted: its blocks are freed and it is
    recomputed later, so nothing fails for lack of memory."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def max_useful_drafts(self, seq: Sequence, k: int) -> int:
        """Drafts beyond max_tokens or the context can never be emitted; don't compute them."""
        # d drafts emit up to d + 1 tokens; past the limit the last draft would only displace the bonus.
        room_in_context = self.config.max_model_len - seq.num_tokens - 1
        room_in_output = seq.params.max_tokens - seq.num_output_tokens - 1
        return max(0, min(k, room_in_context, room_in_output))

    def schedule(self, draft_lens: Mapping[str, int]) -> SchedulerOutput:
        """``draft_lens`` maps request ids of decoding sequences to the drafts wanted this step."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # Running first: they already hold blocks, and finishing them frees memory.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.is_decoding:
                new = 1
                drafts = min(self.max_useful_drafts(seq, draft_lens.get(seq.request_id, 0)), budget - 1)
                # Drafts are optional: shrink them to the free slots before preempting anyone for them.
                free_slots = (len(seq.block_table) + self.block_manager.num_free_blocks) * self.block_manager.block_size
                drafts = max(0, min(drafts, free_slots - seq.num_computed - new))
            else:  # an unfinished chunked prefill
                new, drafts = min(seq.num_uncomputed, budget), 0
            if not self._make_room(seq, seq.num_computed + new + drafts, out):
                continue  # seq itself was preempted; self.running shrank, same index is the next one
            out.scheduled.append(ScheduledSeq(seq, new, drafts))
            budget -= new + drafts
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            new = min(seq.num_uncomputed, budget)
            if not self.block_manager.can_allocate(seq, seq.num_computed + new):
                break  # waiting requests never preempt running ones
            self.block_manager.allocate(seq, seq.num_computed + new)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, new, 0))
            budget -= new
        return out

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Allocate slots for ``num_tokens``, preempting the newest running sequences as needed.
        Returns False if ``seq`` itself had to be preempted."""
        while not self.block_manager.can_allocate(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        self.block_manager.allocate(seq, num_tokens)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark finished and free every block. Safe to call for waiting or running sequences."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
