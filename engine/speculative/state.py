"""What drafting knows about one request, kept on its Sequence so that finishing it is one removal."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.speculative.adaptive import SourceTrack

if TYPE_CHECKING:
    from engine.speculative.ngram import NgramIndex


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
    ngram: NgramIndex | None = None  # the lookup's index of this request's tokens, built on its first lookup

    def track(self, source: str) -> SourceTrack:
        return self.tracks.setdefault(source, SourceTrack())
