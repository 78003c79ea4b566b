"""Which sequences a speculating step asks the lookups for proposals.

While speculation is on, the lookups are asked every step, before the plan, for their real proposals. A
sequence that none of them matched lately (prose, random tokens: the draft model drafts for it) gains nothing
from being asked but the news that nothing matched again, and asking is its index updates and two trie walks:
0.36-0.44 ms of a 9.7 ms speculating step at 8 sequences on 2 CPU cores, 2 ms of 38 at 32 long ones. Such a
sequence is asked once every ``EVERY`` speculating steps, so a request that turns repetitive is still seen
within a few steps; a lookup's index catches up on what it missed at the next ask (the suffix trie's shared
index learns a quiet request's output that much later). Probes and the first plan's asks are not thinned.
"""

from __future__ import annotations

import time

from engine.speculative.ngram import LookupSource
from engine.speculative.source import DraftSource
from engine.speculative.suffix import SuffixSource
from engine.types.sequence import Sequence

QUIET = 0.1  # a lookup proposing on under this share of a sequence's recent asks (about 10 empty asks in a row)
EVERY = 8  # a sequence every lookup is quiet on is asked once every this many speculating steps


def worth_asking(seqs: list[Sequence], lookups: list[str], thin: bool) -> list[Sequence]:
    """Of ``seqs``, those to ask this step: all of them unless ``thin`` (a speculating step's asks)."""
    if not thin:
        return seqs
    out = []
    for seq in seqs:
        d = seq.draft
        tracks = d.tracks
        quiet = all(name in tracks and tracks[name].proposes < QUIET for name in lookups)
        if quiet and d.unasked + 1 < EVERY:
            d.unasked += 1
            continue
        d.unasked = 0
        out.append(seq)
    return out


def index_new(seqs: list[Sequence], lookups: list[DraftSource]) -> float:
    """Indexes, in each lookup, the tokens of those of ``seqs`` it has not indexed yet (a new request's prompt);
    the seconds it took. A request's prompt is indexed once, at its first ask, so that time is no price of asking:
    priced as one, a probe over 31 new 320-token prompts (quoting, 32 concurrent, 2 CPU cores) took 25 ms of
    lookups, the controller's price of asking rose, and speculation on prompts that copy was seldom planned."""
    t0 = time.perf_counter()
    for lookup in lookups:
        if isinstance(lookup, (LookupSource, SuffixSource)):
            lookup.index_new(seqs)
    return time.perf_counter() - t0
