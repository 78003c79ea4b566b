"""What drafts are worth: the expected-token model, the acceptance MLE, each source's per-position gains."""

from __future__ import annotations

import random

import pytest

from engine.speculative.adaptive import SourceAcceptance, expected_tokens
from engine.types.draft_state import AcceptanceEstimate, SourceTrack


@pytest.mark.parametrize(("alpha", "k", "expected"), [(0.5, 0, 1.0), (0.5, 2, 1.75), (0.0, 5, 1.0), (1.0, 3, 4.0),
                                                      (0.9, 1, 1.9), (0.8, 3, 1 + 0.8 + 0.64 + 0.512)])
def test_expected_tokens_is_the_geometric_sum(alpha, k, expected):
    assert expected_tokens(alpha, k) == pytest.approx(expected)


def test_acceptance_counts_one_rejected_trial_only_when_a_draft_was_rejected():
    est = AcceptanceEstimate(decay=1.0)
    est.observe(k=4, accepted=4)  # four successes, no failure seen
    assert (est.hits, est.trials) == (4, 4)
    est.observe(k=4, accepted=1)  # one success, then a failure
    assert (est.hits, est.trials) == (5, 6)
    assert est.value(prior=0.5, prior_weight=0.0) == pytest.approx(5 / 6)
    assert est.value(prior=0.5, prior_weight=2.0) == pytest.approx(6 / 8)


def test_acceptance_estimate_is_the_geometric_mle():
    rng = random.Random(5)
    alpha = 0.7
    est = AcceptanceEstimate(decay=1.0)
    for _ in range(5000):
        k = rng.randint(1, 6)
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        est.observe(k, accepted)
    assert est.value(prior=0.0, prior_weight=0.0) == pytest.approx(alpha, abs=0.015)


def test_acceptance_estimate_without_data_is_the_prior_and_forgets_with_decay():
    assert AcceptanceEstimate().value(prior=0.3) == pytest.approx(0.3)
    est = AcceptanceEstimate(decay=0.5)
    for _ in range(20):
        est.observe(4, 4)
    for _ in range(20):
        est.observe(4, 0)
    assert est.value(prior=0.5, prior_weight=0.0) < 0.01


def test_gains_are_geometric_in_the_sequences_own_alpha_while_positions_agree():
    acc = SourceAcceptance(k_max=4)
    track = SourceTrack()
    for _ in range(50):
        acc.observe(track, 4, 2)  # positions 0 and 1 hold, 2 fails: the per-position shape is far from flat
    fresh = SourceTrack()
    alpha = acc.alpha(fresh)
    assert alpha == pytest.approx(acc.global_alpha.value(prior=0.5))
    g = list(acc.gains([fresh])[0])
    assert len(g) == 4 and all(a >= b for a, b in zip(g, g[1:])), "non-increasing"
    assert g[1] > 0.8 and g[2] < 0.1, "the first two drafts nearly always hold, the third nearly never"


def test_gains_have_one_row_per_sequence_and_scale():
    acc = SourceAcceptance(k_max=8)
    track = SourceTrack()
    for _ in range(20):
        acc.observe(track, 3, 3)
    assert acc.gains([track, track]).shape == (2, 8)
    assert acc.gains([track], scale=0.5)[0] == pytest.approx(0.5 * acc.gains([track])[0])


def test_a_sequence_with_a_better_record_gets_larger_gains():
    acc = SourceAcceptance(k_max=4)
    good, bad = SourceTrack(), SourceTrack()
    for _ in range(10):
        acc.observe(good, 4, 4)
        acc.observe(bad, 4, 0)
    assert (acc.gains([good])[0] > acc.gains([bad])[0]).all()
    assert acc.alpha(good) > acc.alpha(SourceTrack()) > acc.alpha(bad), "a fresh track starts at the source's rate"


def test_observing_zero_drafts_changes_nothing():
    acc = SourceAcceptance(k_max=4)
    track = SourceTrack()
    acc.observe(track, 0, 0)
    assert track.alpha is None and acc.global_alpha.trials == 0

