"""Which sequences a speculating step asks the lookups for: the quiet ones now and then."""

from __future__ import annotations

from engine.speculative.asking import EVERY, QUIET, worth_asking
from engine.types.sampling_params import SamplingParams
from engine.types.sequence import Sequence


def seqs(proposes: list[float | None]) -> list[Sequence]:
    """One sequence per entry: its lookups' share of asks that proposed (None: never asked)."""
    out = []
    for i, p in enumerate(proposes):
        s = Sequence(str(i), [1, 2, 3], SamplingParams())
        if p is not None:
            for name in ("ngram", "suffix"):
                s.draft.track(name).proposes = p
        out.append(s)
    return out


def test_a_sequence_no_lookup_matched_lately_is_asked_once_every_few_speculating_steps():
    batch = seqs([QUIET / 2, 0.5, None])
    asked = [[s.request_id for s in worth_asking(batch, ["ngram", "suffix"], True)] for _ in range(2 * EVERY)]
    assert all("1" in a and "2" in a for a in asked), "one that matches lately, or was never asked: every step"
    assert [i for i, a in enumerate(asked) if "0" in a] == [EVERY - 1, 2 * EVERY - 1]


def test_one_lookup_that_still_matches_keeps_the_sequence_asked():
    (s,) = seqs([QUIET / 2])
    s.draft.track("suffix").proposes = 0.3
    assert all(worth_asking([s], ["ngram", "suffix"], True) == [s] for _ in range(EVERY))


def test_probes_and_first_plans_ask_everyone():
    batch = seqs([0.0, 0.0])
    assert all(worth_asking(batch, ["ngram"], False) == batch for _ in range(EVERY))
