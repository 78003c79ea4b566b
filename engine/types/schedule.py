"""A step's schedule: who runs, with how many new tokens, draft slots and catch-up tokens. The scheduler
(engine.sched) writes it; the runner, the drafters and the stats read it."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.types.sequence import Sequence


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    logit_rows: int = 2**31  # the largest prompt chunk of a request scoring its prompt (EngineConfig.logit_rows)
    prefill_hold_steps: int = 0  # EngineConfig.prefill_hold_steps; 0 admits every prompt at once
    prefill_group_tokens: int = 512  # EngineConfig.prefill_group_tokens


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # fed from token_ids[num_computed:]
    num_draft_slots: int  # capacity reserved for drafts; the drafter may fill fewer
    num_catch_up: int = 0  # tokens its draft source processes before drafting (counted in the budget)

    @property
    def samples(self) -> bool:
        """This step reaches the end of the sequence's known tokens, so it yields a token (unless the request only
        scores its prompt: max_tokens 0)."""
        seq = self.seq
        return seq.num_computed + self.num_new_tokens == seq.num_tokens and seq.params.max_tokens > 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    prefix_queried: int = 0  # tokens of the sequences admitted this step, looked up in the prefix cache
    prefix_hit: int = 0  # of those, tokens found there
    held_prompts: int = 0  # waiting prompts held this step for others to be prefilled with (Scheduler._holds_prompts)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_draft_slots + s.num_catch_up for s in self.scheduled)
