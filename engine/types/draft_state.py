"""What drafting knows about one request, kept on its Sequence so that finishing it is one removal."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

# The draft source label of tokens a request's grammar forces (engine.speculative.forced): stats and metrics
# count them apart from the source that drafted the rest of a step.
GRAMMAR_SOURCE = "grammar"


class TokenIndex(Protocol):
    """A lookup drafter's index of one request's tokens (engine.speculative.ngram), kept on the request."""

    def lookup(self, tokens: list[int], k: int) -> list[int]: ...


class SuffixState(Protocol):
    """A suffix drafter's state for one request (engine.speculative.suffix): its own index of the request's
    tokens and its stream in the index shared by all requests."""

    @property
    def synced(self) -> int:
        """Tokens of the request indexed so far."""
        ...


@dataclass
class AcceptanceEstimate:
    """Exponentially weighted MLE of alpha under the geometric model: a step with k drafts and a
    accepted is a accepted trials plus one rejected trial when a < k."""

    hits: float = 0.0
    trials: float = 0.0
    decay: float = 0.8

    def observe(self, k: int, accepted: int) -> None:
        self.hits = self.decay * self.hits + accepted
        self.trials = self.decay * self.trials + accepted + (1 if accepted < k else 0)

    def fade(self, factor: float) -> None:
        """Forget a share of the evidence (the estimate moves toward the prior)."""
        self.hits *= factor
        self.trials *= factor

    def value(self, prior: float, prior_weight: float = 2.0) -> float:
        return (self.hits + prior * prior_weight) / (self.trials + prior_weight)


@dataclass
class SourceTrack:
    """One sequence's history with one draft source, kept on the sequence (``seq.draft``)."""

    alpha: AcceptanceEstimate | None = None  # None until the source has drafted for it
    proposes: float = 1.0  # a lookup's: moving share of asks that found a proposal (1.0 until asked)


@dataclass
class DraftState:
    """This step's plan (set by ``Drafting.plan``, read by the scheduler and ``Drafting.propose``)
    and the request's acceptance history per source."""

    source: str | None = None  # where this step's drafts come from; None: no drafts
    k: int = 0  # drafts wanted this step
    lag: int = 0  # tokens the source must process before it can draft (a draft model's catch-up)
    lookup: list[int] = field(default_factory=list)  # the lookup's proposal: the drafts, or a shadow
    forced: list[int] = field(default_factory=list)  # what the request's grammar allows as the only continuation
    extend: int = 0  # of the k slots, those kept for tokens the grammar forces after the source's own drafts
    forced_at: int = 0  # where this step's forced drafts begin among its drafts, and how many there are
    num_forced: int = 0

    @property
    def own(self) -> int:
        """Drafts wanted from the source itself."""
        return self.k - self.extend
    tracks: dict[str, SourceTrack] = field(default_factory=dict)
    ngram: TokenIndex | None = None  # the lookup's index of this request's tokens, built on its first lookup
    suffix: SuffixState | None = None  # the suffix drafter's, built on its first draft
    proposals: dict[str, list[int]] = field(default_factory=dict)  # this step's proposal of each lookup source
    unasked: int = 0  # speculating steps since the lookups were last asked for it (engine.speculative.asking)

    def clear_plan(self) -> None:
        """Forget the last step's plan and proposals (the history in ``tracks`` stays)."""
        self.source, self.k, self.lag, self.lookup, self.forced = None, 0, 0, [], []
        self.extend = self.forced_at = self.num_forced = 0
        self.proposals = {}

    def track(self, source: str) -> SourceTrack:
        return self.tracks.setdefault(source, SourceTrack())
