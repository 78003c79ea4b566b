"""The grammar as a draft source: where it allows exactly one continuation (keys, punctuation, enum
literals, closing brackets), those tokens are the drafts. They cost no forward, and the masked target
accepts them with certainty, so each one is a whole token gained per step. Also what the grammar does to the
other sources' drafts: cut them where it forbids one, and extend them with what it forces after them."""

from __future__ import annotations

from engine.speculative.source import DraftRequest, Proposal
from engine.types.draft_state import GRAMMAR_SOURCE
from engine.types.schedule import ScheduledSeq
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

    def drain_costs(self) -> list[tuple[int, float, bool]]:
        return []


FORCED = ForcedSource()


def grammatical(scheduled: list[ScheduledSeq], tokens: list[list[int]]) -> list[list[int]]:
    """Each structured sequence's drafts cut at the first one its grammar forbids: the masked target gives
    that draft probability 0, so it and everything after it would be rejected anyway; cutting spares the
    target their rows (and an EOS draft ends them, since the grammar then allows nothing)."""
    for i, s in enumerate(scheduled):
        grammar = s.seq.grammar
        if grammar is not None and tokens[i]:
            tokens[i] = tokens[i][: grammar.valid_prefix(tokens[i])]
    return tokens


def with_forced(scheduled: list[ScheduledSeq], tokens: list[list[int]]) -> list[list[int]]:
    """Appends to each structured sequence's drafts what its grammar forces after them, into the slots
    kept for it (``DraftState.extend``), and records where the forced drafts are (for the stats and
    so that a source's acceptance is learned from its own drafts only)."""
    for i, s in enumerate(scheduled):
        d, grammar = s.seq.draft, s.seq.grammar
        if d.source == FORCED.name:
            d.forced_at, d.num_forced = 0, len(tokens[i])
        elif grammar is not None and d.extend and tokens[i]:
            room = s.num_draft_slots - len(tokens[i])
            if room > 0:
                grammar.push(tokens[i])
                extra = grammar.forced()[:room]
                grammar.pop(len(tokens[i]))
                d.forced_at, d.num_forced = len(tokens[i]), len(extra)
                tokens[i] = tokens[i] + extra
    return tokens
