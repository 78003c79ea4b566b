"""Self-speculative drafting: the target's first L layers, its final norm and its LM head draft.

The draft runner (ModelRunner.early_exit) shares the target's modules and its paged KV cache, so the
draft has no cache of its own and never lags: after a step, layers [0, L) hold valid K/V for exactly
the tokens the target computed, since the target wrote them. Drafting writes those layers' K/V for the
last token and the drafts, at positions the step's verification forward then overwrites with the
target's own values (every position a draft fills is among the positions the target feeds after it,
and each attention writes its new K/V before reading any), so whatever the drafts were, the cache the
target reads is the target's. Positions a cut draft list leaves unverified lie past ``num_computed``,
which nothing reads before it is written again.
"""

from __future__ import annotations

from engine.speculative.draft_model import DraftModelSource
from engine.types.sequence import Sequence


class SelfDraftSource(DraftModelSource):
    name = "self"

    def lag(self, seq: Sequence) -> int:
        return 0

    def _computed(self, seq: Sequence) -> int:
        return seq.num_computed

    def _advance(self, seq: Sequence, num_computed: int) -> None:
        pass  # the target's num_computed is the draft's too, and only verification moves it
