"""Plain stats the engine emits; the server turns them into Prometheus series."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.outputs import RequestOutput, Verdict
    from engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class StepStats:
    """What one engine step did. ``accepted_lengths`` has one entry per sequence that sampled:
    the tokens it emitted (accepted drafts + 1)."""

    num_scheduled: int
    num_prompt_tokens: int  # prompt (or recomputed) tokens fed this step
    num_generated_tokens: int  # tokens appended to outputs this step
    num_drafts: int  # sequences that verified at least one draft
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]
    accepted_lengths: tuple[int, ...]
    num_decoding: int  # sequences that sampled with at most one new token (plus drafts) this step
    mean_k: float  # drafts verified per decoding sequence
    num_preempted: int
    num_running: int
    num_waiting: int
    kv_usage: float
    draft_seconds: float
    target_seconds: float
    step_seconds: float
    audit_results: tuple[str, ...] = ()  # losslessness audits judged this step: "match", "mismatch", "near_tie"
    prefix_cache_queries: int = 0  # tokens of the sequences admitted this step, looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens whose K/V came from it
    num_forced_draft_tokens: int = 0  # of num_draft_tokens, those the grammar forced (engine.structured.forced)
    num_forced_accepted_tokens: int = 0
    grammar_seconds: float = 0.0  # computing grammar masks within the step
    grammar_compile_seconds: tuple[float, ...] = ()  # one per structured request queued since the last step

    @classmethod
    def of(
        cls, sched: SchedulerOutput, verdicts: list[Verdict | None], outputs: list[RequestOutput], num_prompt: int,
        audits: tuple[str, ...], num_running: int, num_waiting: int, kv_usage: float,
        draft_seconds: float, target_seconds: float, step_seconds: float,
        grammar_seconds: float = 0.0, grammar_compile_seconds: tuple[float, ...] = (),
    ) -> StepStats:
        drafted = [v for v in verdicts if v is not None and v.num_drafts]
        # (drafted, accepted) of the forced drafts, which sit at [forced_at, forced_at + num_forced).
        forced = [(s.seq.draft.num_forced, min(max(0, v.num_accepted - s.seq.draft.forced_at), s.seq.draft.num_forced))
                  for s, v in zip(sched.scheduled, verdicts) if v is not None and v.num_drafts]
        pos_counts = [0] * max((v.num_drafts for v in drafted), default=0)
        for v in drafted:
            for j in range(v.num_accepted):
                pos_counts[j] += 1
        decoding = sum(1 for s, v in zip(sched.scheduled, verdicts) if v is not None and s.num_new_tokens == 1)
        n_draft_tokens = sum(v.num_drafts for v in drafted)
        return cls(
            num_scheduled=len(sched.scheduled),
            num_prompt_tokens=num_prompt,
            num_generated_tokens=sum(len(o.new_token_ids) for o in outputs),
            num_drafts=len(drafted),
            num_draft_tokens=n_draft_tokens,
            num_accepted_tokens=sum(v.num_accepted for v in drafted),
            accepted_per_position=tuple(pos_counts),
            accepted_lengths=tuple(v.num_accepted + 1 for v in drafted),
            num_decoding=decoding,
            mean_k=n_draft_tokens / decoding if decoding else 0.0,
            num_preempted=len(sched.preempted),
            prefix_cache_queries=sched.prefix_queried,
            prefix_cache_hits=sched.prefix_hit,
            num_running=num_running,
            num_waiting=num_waiting,
            kv_usage=kv_usage,
            draft_seconds=draft_seconds,
            target_seconds=target_seconds,
            step_seconds=step_seconds,
            audit_results=audits,
            num_forced_draft_tokens=sum(n for n, _ in forced),
            num_forced_accepted_tokens=sum(a for _, a in forced),
            grammar_seconds=grammar_seconds,
            grammar_compile_seconds=grammar_compile_seconds,
        )


@dataclass
class AuditStats:
    """Cumulative losslessness audit results (engine.audit)."""

    match: int = 0
    mismatch: int = 0
    near_tie: int = 0

    def add(self, results: Iterable[str]) -> None:
        for r in results:
            setattr(self, r, getattr(self, r) + 1)


@dataclass
class SpecDecodeStats:
    """Cumulative speculation counters since the engine started."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_forced_draft_tokens: int = 0
    num_forced_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step: accepted drafts plus the recovered or bonus token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def add(self, step: StepStats) -> None:
        self.num_drafts += step.num_drafts
        self.num_draft_tokens += step.num_draft_tokens
        self.num_accepted_tokens += step.num_accepted_tokens
        self.num_forced_draft_tokens += step.num_forced_draft_tokens
        self.num_forced_accepted_tokens += step.num_forced_accepted_tokens
        pos = self.accepted_per_position
        pos.extend([0] * (len(step.accepted_per_position) - len(pos)))
        for i, n in enumerate(step.accepted_per_position):
            pos[i] += n
