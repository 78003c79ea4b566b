"""Plain stats the engine emits; the server turns them into Prometheus series."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from engine.types.draft_state import GRAMMAR_SOURCE

if TYPE_CHECKING:
    from engine.types.draft_state import DraftState
    from engine.types.outputs import RequestOutput, Verdict
    from engine.types.schedule import SchedulerOutput


@dataclass(frozen=True)
class DraftShare:
    """One source's drafts in one sequence's verified step: positions [start, start + drafted) of the
    step's drafts, of which the first ``accepted`` were accepted."""

    source: str
    start: int
    drafted: int
    accepted: int


def shares(draft: DraftState, num_drafts: int, num_accepted: int) -> tuple[DraftShare, ...]:
    """Who proposed a verified step's drafts, in order: ``draft.source`` the first ones, the grammar
    (engine.speculative.forced) those it forced, at [forced_at, forced_at + num_forced). ``num_accepted`` is the
    accepted prefix of the ``num_drafts`` drafts. A source that proposed none of them is left out."""
    own = min(draft.forced_at, num_drafts) if draft.num_forced else num_drafts
    parts = ((draft.source, 0, own), (GRAMMAR_SOURCE, own, min(draft.num_forced, num_drafts - own)))
    return tuple(
        DraftShare(name, start, n, min(max(0, num_accepted - start), n)) for name, start, n in parts if name and n
    )


@dataclass(frozen=True)
class ForwardCounts:
    """Forwards of the compiled models (target and drafts together) since start: each field sums the
    CompiledForward attribute of its name."""

    uncompiled: int  # decode and verify forwards in a layout no graph covers, run eagerly
    prompt_compiled: int  # forwards with a prompt chunk that a loaded prompt graph served
    prompt_eager: int  # forwards with a prompt chunk that ran eagerly (no graph fits, or none loaded)


@dataclass(frozen=True)
class SourceStepStats:
    """One draft source's part of a step. A sequence-step counts once, in ``num_drafts`` of the source that
    drafted first in it (grammar-forced drafts after a source's own add tokens to "grammar", not a sequence-step),
    so that each field summed over the sources is the step's total."""

    name: str
    num_drafts: int  # sequence-steps whose drafts this source began
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]  # by position among the step's drafts: 0 where it drafted none

    @classmethod
    def of(cls, per_seq: Iterable[tuple[DraftShare, ...]]) -> tuple[SourceStepStats, ...]:
        """Each source's totals, in the order they first appear, from each drafting sequence's shares."""
        sums: dict[str, tuple[int, int, int, list[int]]] = {}
        for seq_shares in per_seq:
            for i, s in enumerate(seq_shares):
                drafts, tokens, accepted, pos = sums.get(s.source, (0, 0, 0, []))
                pos.extend([0] * (s.start + s.drafted - len(pos)))
                for j in range(s.start, s.start + s.accepted):
                    pos[j] += 1
                sums[s.source] = (drafts + (i == 0), tokens + s.drafted, accepted + s.accepted, pos)
        return tuple(cls(name, d, t, a, tuple(pos)) for name, (d, t, a, pos) in sums.items())


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
    num_held_prompts: int = 0  # waiting prompts held this step, to be prefilled with later ones
    num_forced_draft_tokens: int = 0  # of num_draft_tokens, those the grammar forced (engine.speculative.forced)
    num_forced_accepted_tokens: int = 0
    grammar_seconds: float = 0.0  # computing grammar masks within the step
    grammar_compile_seconds: tuple[float, ...] = ()  # one per structured request queued since the last step
    by_source: tuple[SourceStepStats, ...] = ()  # the speculation fields above, split by the source that drafted
    num_draft_forwards: int = 0  # forwards the model drafters ran (catch-ups included)
    # The goodput controller's choice: "plain", "probe" (plain, lookups asked), "speculate"; "" where it planned
    # nothing (a fixed k, no speculation, no sequence decoding on the adaptive path).
    speculation: str = ""
    predicted_speedup: float = 1.0  # its expected tokens per second over the plain step's

    @classmethod
    def of(
        cls, sched: SchedulerOutput, verdicts: list[Verdict | None], outputs: list[RequestOutput], num_prompt: int,
        audits: tuple[str, ...], num_running: int, num_waiting: int, kv_usage: float,
        draft_seconds: float, target_seconds: float, step_seconds: float,
        grammar_seconds: float = 0.0, grammar_compile_seconds: tuple[float, ...] = (),
    ) -> StepStats:
        drafted = [v for v in verdicts if v is not None and v.num_drafts]
        by_source = SourceStepStats.of(shares(s.seq.draft, v.num_drafts, v.num_accepted)
                                       for s, v in zip(sched.scheduled, verdicts) if v is not None and v.num_drafts)
        forced = next((s for s in by_source if s.name == GRAMMAR_SOURCE), None)
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
            mean_k=ratio(n_draft_tokens, decoding),
            num_preempted=len(sched.preempted),
            prefix_cache_queries=sched.prefix_queried,
            prefix_cache_hits=sched.prefix_hit,
            num_held_prompts=sched.held_prompts,
            num_running=num_running,
            num_waiting=num_waiting,
            kv_usage=kv_usage,
            draft_seconds=draft_seconds,
            target_seconds=target_seconds,
            step_seconds=step_seconds,
            audit_results=audits,
            num_forced_draft_tokens=forced.num_draft_tokens if forced else 0,
            num_forced_accepted_tokens=forced.num_accepted_tokens if forced else 0,
            grammar_seconds=grammar_seconds,
            grammar_compile_seconds=grammar_compile_seconds,
            by_source=by_source,
        )


@dataclass
class AuditStats:
    """Cumulative losslessness audit results (engine.core.audit)."""

    match: int = 0
    mismatch: int = 0
    near_tie: int = 0

    def add(self, results: Iterable[str]) -> None:
        for r in results:
            setattr(self, r, getattr(self, r) + 1)


def ratio(num: int, den: int) -> float:
    """num / den, and 0 over nothing: the rule of every mean and rate over steps (the metrics docs' "0 without
    drafts"), so that an idle window or interval reads 0 rather than NaN."""
    return num / den if den else 0.0


@dataclass
class SourceStats:
    """One draft source's counts summed over steps (SourceStepStats summed)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return ratio(self.num_accepted_tokens, self.num_draft_tokens)

    def add(self, step: SourceStepStats, sign: int = 1) -> None:
        """``sign`` -1 takes a step back out (a sliding window)."""
        self.num_drafts += sign * step.num_drafts
        self.num_draft_tokens += sign * step.num_draft_tokens
        self.num_accepted_tokens += sign * step.num_accepted_tokens


@dataclass
class StepTotals:
    """StepStats summed over a set of steps: since the engine started (``LLM.stats()``), over the /metrics
    sliding window, or over the stats log's interval. Every mean and rate over steps is defined here once,
    so that the log, /metrics and the engine read the same number from the same steps. ``by_source`` splits
    the speculation sums by the source that drafted (keyed by its name, e.g. "draft_model", "ngram",
    "self", "grammar")."""

    num_steps: int = 0
    num_prompt_tokens: int = 0  # prefill work, recomputation after preemption included
    num_generated_tokens: int = 0
    num_drafts: int = 0  # sequence-steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_forced_draft_tokens: int = 0
    num_forced_accepted_tokens: int = 0
    num_decoding: int = 0  # decoding sequence-steps: the denominator of the mean k
    num_preempted: int = 0
    prefix_cache_queries: int = 0  # admitted tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, found there
    num_draft_forwards: int = 0
    speculation: dict[str, int] = field(default_factory=dict)  # steps by the goodput controller's choice
    by_source: dict[str, SourceStats] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens; 0 without drafts."""
        return ratio(self.num_accepted_tokens, self.num_draft_tokens)

    def acceptance_rate_of(self, source: str) -> float:
        """One draft source's accepted / drafted tokens; 0 without its drafts."""
        s = self.by_source.get(source)
        return s.acceptance_rate if s is not None else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """The mean of the accepted-length histogram (specd:spec_decode_accepted_length): tokens emitted per
        drafting sequence-step, accepted drafts + 1 (StepStats.accepted_lengths sum to num_accepted_tokens
        + num_drafts); 0 without drafts, since a histogram with no observations has no mean to report."""
        return ratio(self.num_accepted_tokens + self.num_drafts, self.num_drafts)

    @property
    def mean_k(self) -> float:
        """Drafts per decoding sequence-step: the k the adaptive policy has been choosing; 0 without any."""
        return ratio(self.num_draft_tokens, self.num_decoding)

    def add(self, step: StepStats, sign: int = 1) -> None:
        """``sign`` -1 takes a step back out (a sliding window)."""
        self.num_steps += sign
        self.num_prompt_tokens += sign * step.num_prompt_tokens
        self.num_generated_tokens += sign * step.num_generated_tokens
        self.num_drafts += sign * step.num_drafts
        self.num_draft_tokens += sign * step.num_draft_tokens
        self.num_accepted_tokens += sign * step.num_accepted_tokens
        self.num_forced_draft_tokens += sign * step.num_forced_draft_tokens
        self.num_forced_accepted_tokens += sign * step.num_forced_accepted_tokens
        self.num_decoding += sign * step.num_decoding
        self.num_preempted += sign * step.num_preempted
        self.prefix_cache_queries += sign * step.prefix_cache_queries
        self.prefix_cache_hits += sign * step.prefix_cache_hits
        self.num_draft_forwards += sign * step.num_draft_forwards
        if step.speculation:
            self.speculation[step.speculation] = self.speculation.get(step.speculation, 0) + sign
        pos = self.accepted_per_position
        pos.extend([0] * (len(step.accepted_per_position) - len(pos)))
        for i, n in enumerate(step.accepted_per_position):
            pos[i] += sign * n
        for source in step.by_source:
            self.by_source.setdefault(source.name, SourceStats()).add(source, sign)

    def copy(self) -> StepTotals:
        return replace(self, accepted_per_position=list(self.accepted_per_position), speculation=dict(self.speculation),
                       by_source={name: replace(s) for name, s in self.by_source.items()})
