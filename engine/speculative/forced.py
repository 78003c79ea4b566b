"""The grammar as a draft source: where it allows exactly one continuation (keys, punctuation, enum
literals, closing brackets), those tokens are the drafts. They cost no forward, and the masked target
accepts them with certainty, so each one is a whole token gained per step."""

from __future__ import annotations

from engine.speculative.source import DraftRequest, Proposal
from engine.types.draft_state import GRAMMAR_SOURCE
from engine.types.sequence import Sequence


class ForcedSource:
    name = GRAMMAR_SOURCE

    def lag(self, seq: Sequence) -> int:
        return 0

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        return Proposal(
            tokens=[r.seq.grammar.forced()[: r.max_drafts] if r.seq.grammar is not None else [] for r in requests],
            probs=None,
        )

    def drain_costs(self) -> list[tuple[int, float]]:
        return []


FORCED = ForcedSource()
