"""Waiting -> running under a per-step token budget and the KV block budget; after the step, append
the verified tokens, roll back, check stops and free. No torch."""

from __future__ import annotations

import logging
from collections import deque

from engine.sched.block_manager import BlockManager
from engine.sched.stop import StopChecker
from engine.types.outputs import RequestOutput, Verdict
from engine.types.schedule import ScheduledSeq, SchedulerConfig, SchedulerOutput
from engine.types.sequence import FinishReason, Sequence, SequenceStatus, SourceTokens
from engine.types.stats import shares

logger = logging.getLogger(__name__)


class Scheduler:
    """FIFO continuous batching. Running sequences are served first (oldest first); waiting ones
    join while the token budget, ``max_num_seqs`` and free blocks allow, then background ones (audits)
    if nothing else waits. A long prompt is fed in chunks across steps (chunked prefill is the same
    operation as decode with more tokens). When blocks run out, the newest running sequence is
    preempted: its blocks are freed and it is recomputed later, so nothing fails for lack of memory. A prompt that
    arrives while the batch decodes may wait a few steps for others to be prefilled with it (``_holds_prompts``)."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, stop: StopChecker) -> None:
        self.config = config
        self.block_manager = block_manager
        self.stop = stop
        self.waiting: deque[Sequence] = deque()
        self.background: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._steps = 0  # schedule() calls: the clock prompts are held by
        self._queued_at: dict[int, int] = {}  # id of a waiting sequence -> the step it joined the queue
        self._arrivals: deque[int] = deque()  # the steps at which prompts arrived lately, each step once

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.stop.start(seq)
        if seq.background:
            self.background.append(seq)
        else:
            self.waiting.append(seq)
            self._queued_at[id(seq)] = self._steps
            if not self._arrivals or self._arrivals[-1] != self._steps:
                self._arrivals.append(self._steps)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.background)

    def max_useful_drafts(self, seq: Sequence, k: int) -> int:
        """Drafts beyond max_tokens or the context can never be emitted; don't compute them."""
        # d drafts emit up to d + 1 tokens; past the limit the last draft would only displace the bonus.
        room_in_context = self.config.max_model_len - seq.num_tokens - 1
        room_in_output = seq.params.max_tokens - seq.num_output_tokens - 1
        return max(0, min(k, room_in_context, room_in_output))

    def schedule(self) -> SchedulerOutput:
        """Decoding sequences ask for ``seq.draft.k`` drafts after ``seq.draft.lag`` tokens of catch-up
        by their draft source; both count against the token budget, so it bounds a step's real work."""
        out = SchedulerOutput()
        self._steps += 1
        budget = self.config.max_num_batched_tokens
        # Running first: they already hold blocks, and finishing them frees memory.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            catch_up = 0
            if seq.is_decoding:
                new = 1
                useful = self.max_useful_drafts(seq, seq.draft.k)
                lag = seq.draft.lag if useful else 0
                # Drafts are optional: shrink them to the free slots before preempting anyone for them.
                free_slots = (len(seq.block_table) + self.block_manager.num_free_blocks) * self.block_manager.block_size
                drafts = max(0, min(useful, budget - 1 - lag, free_slots - seq.num_computed - new))
                # Without room to draft, the source still catches up as far as the budget allows.
                catch_up = lag if drafts else min(lag, budget - 1)
            else:  # an unfinished chunked prefill
                new, drafts = self._chunk(seq, seq.num_uncomputed, budget), 0
            if not self._make_room(seq, seq.num_computed + new + drafts, out):
                continue  # seq itself was preempted; self.running shrank, same index is the next one
            out.scheduled.append(ScheduledSeq(seq, new, drafts, catch_up))
            budget -= new + drafts + catch_up
            i += 1
        if self._holds_prompts(out):
            out.held_prompts = len(self.waiting)
            return out
        for queue in (self.waiting, self.background):
            if queue is self.background and self.waiting:
                break
            while queue and budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = queue[0]
                hit = self.block_manager.match(seq)
                if self._prefix_in_flight(seq, len(hit)):
                    break  # next step it reuses what a running sequence is computing now
                cached = len(hit) * self.block_manager.block_size
                new = self._chunk(seq, seq.num_tokens - cached, budget)
                if not self.block_manager.can_reuse(seq, hit, cached + new):
                    break  # waiting requests never preempt running ones
                self.block_manager.reuse(seq, hit)
                self.block_manager.allocate(seq, cached + new)
                out.prefix_queried += seq.num_tokens
                out.prefix_hit += cached
                if not seq.num_preemptions:
                    seq.prefix.cached_tokens = cached
                queue.popleft()
                self._queued_at.pop(id(seq), None)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.scheduled.append(ScheduledSeq(seq, new, 0))
                budget -= new
        return out

    def _holds_prompts(self, out: SchedulerOutput) -> bool:
        """Whether the waiting prompts wait this step for others. A prompt prefilled alone beside a decoding batch
        costs more a token than prompts prefilled together: its chunk is a small matmul (on 2 CPU cores 0.28 ms a
        token at 168 tokens, 0.2 ms at 500), and on CUDA an eager forward among graph replays. Speculation makes that
        common: requests that accept drafts at different rates end at different steps, so their successors arrive one
        by one. So a prompt waits while the batch decodes and no prompt chunk is in the step, for at most
        ``prefill_hold_steps`` steps, while another is due within them at the recent arrival rate, and until the
        waiting prompts make ``prefill_group_tokens``. The rate counts steps that saw an arrival, not arrivals: a
        burst arrives together and is prefilled together anyway, and must not make the stragglers after it wait. At
        low load no other is due, so none waits. vLLM's V0 scheduler had a delay of this kind
        (``scheduler_delay_factor``), without the arrival rate."""
        hold = self.config.prefill_hold_steps
        window = 8 * hold  # the arrival rate is counted over the last 8 holds
        while self._arrivals and self._arrivals[0] <= self._steps - window:
            self._arrivals.popleft()
        if not self.waiting or not hold or not out.scheduled:
            return False
        if any(not s.seq.is_decoding for s in out.scheduled):
            return False  # the step carries a prompt chunk already: join it
        if self._steps - self._queued_at[id(self.waiting[0])] > hold:
            return False
        if sum(seq.num_tokens for seq in self.waiting) >= self.config.prefill_group_tokens:
            return False
        # rate * hold >= 1, with rate = arrival steps / window: another arrival is due within the hold.
        return len(self._arrivals) * hold >= window

    def _chunk(self, seq: Sequence, tokens: int, budget: int) -> int:
        """A prefill chunk. One that scores its prompt takes logits for every position: it is held to the rows of
        logits the memory plan reserves (EngineConfig.logit_rows)."""
        if seq.params.prompt_logprobs is not None:
            budget = min(budget, self.config.logit_rows)
        return min(tokens, budget)

    def _prefix_in_flight(self, seq: Sequence, num_hit: int) -> bool:
        """Whether the block after a waiting sequence's cache hit is being computed by a running one."""
        if num_hit >= (seq.num_tokens - 1) // self.block_manager.block_size:
            return False
        bm = self.block_manager
        following = bm.hashes(seq, num_hit + 1)[num_hit]
        return any(following in bm.filling(r) for r in self.running)

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
        if seq.background:
            self.background.appendleft(seq)
        else:
            self.waiting.appendleft(seq)
            self._queued_at[id(seq)] = self._steps

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark finished and free every block. Safe to call for waiting or running sequences."""
        for queue in (self.running, self.waiting, self.background):
            if seq in queue:
                queue.remove(seq)
                break
        self._queued_at.pop(id(seq), None)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # ---- after the forward ----------------------------------------------------------------------

    def update(self, sched: SchedulerOutput, verdicts: list[Verdict | None]) -> list[RequestOutput]:
        """``verdicts[i]`` is the verified outcome of ``sched.scheduled[i]`` (None where it did not
        sample). Appends tokens until a stop condition, rolls the caches back by length, frees the
        finished; returns one delta per sampling sequence."""
        outputs = []
        for s, verdict in zip(sched.scheduled, verdicts):
            seq = s.seq
            if verdict is None:
                seq.num_computed += s.num_new_tokens
                self.block_manager.register(seq)
                if seq.params.max_tokens == 0 and seq.num_computed == seq.num_tokens:  # its prompt scored: done
                    self.finish(seq, FinishReason.LENGTH)
                    outputs.append(RequestOutput.of(seq, [], "", []))
                continue
            if verdict.error is not None:
                logger.error("request %s failed: %s", seq.request_id, verdict.error)
                outputs.append(self.fail(seq))
                continue
            seq.num_draft_tokens += verdict.num_drafts
            seq.num_accepted_tokens += verdict.num_accepted
            for share in shares(seq.draft, verdict.num_drafts, verdict.num_accepted):  # this step's plan, still set
                by = seq.spec_by_source
                by[share.source] = by.get(share.source, SourceTokens()).plus(share.drafted, share.accepted)
            try:
                outputs.append(self._append(seq, verdict))
            except Exception:  # e.g. the detokenizer on this sequence's text: fail it, not the whole batch
                logger.exception("request %s failed while appending its tokens", seq.request_id)
                outputs.append(self.fail(seq))
        return outputs

    def fail(self, seq: Sequence) -> RequestOutput:
        """Finish one sequence with finish_reason "error" (its blocks freed); the rest of the batch goes on."""
        self.finish(seq, FinishReason.ERROR)
        return RequestOutput.of(seq, [], "", [])

    def _append(self, seq: Sequence, verdict: Verdict) -> RequestOutput:
        kept, reason = [], None
        for token in verdict.tokens:
            seq.token_ids.append(token)
            kept.append(token)
            if seq.grammar is not None:
                seq.grammar.advance(token)
                if seq.grammar.lifted:
                    seq.grammar = None  # token healing re-spelled the prompt's end: the rest is unconstrained
            reason = self.stop.check(seq, token)
            if reason is not None:
                break
        # Every kept token but the last was fed this step (the last known token or an accepted draft),
        # so has valid K/V; K/V written for rejected drafts are forgotten by this length alone.
        seq.num_computed = seq.num_tokens - 1
        seq.draft_num_computed = min(seq.draft_num_computed, seq.num_computed)
        self.block_manager.register(seq)  # before finishing: the next chat turn starts with this text
        if reason is not None:
            self.finish(seq, reason)
        logprobs = verdict.logprobs[: len(kept)]
        seq.logprobs.extend(logprobs)
        return RequestOutput.of(seq, kept, self.stop.release(seq), logprobs)
