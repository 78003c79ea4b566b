"""Plain stats the engine emits; the server turns them into Prometheus series."""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass
class SpecDecodeStats:
    """Cumulative speculation counters since the engine started."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

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
        pos = self.accepted_per_position
        pos.extend([0] * (len(step.accepted_per_position) - len(pos)))
        for i, n in enumerate(step.accepted_per_position):
            pos[i] += n
