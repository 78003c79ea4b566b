"""Adaptive draft length: the expected-token model, the cost fit, the acceptance MLE, the policy."""

from __future__ import annotations

import random

import pytest

from engine.speculative.adaptive import (
    AcceptanceEstimate,
    AdaptivePolicy,
    LinearCost,
    SourceTrack,
    best_k,
    expected_tokens,
)

ALPHAS = [0.0, 0.1, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99]
COSTS = [0.0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 2.0]


@pytest.mark.parametrize(("alpha", "k", "expected"), [(0.5, 0, 1.0), (0.5, 2, 1.75), (0.0, 5, 1.0), (1.0, 3, 4.0),
                                                      (0.9, 1, 1.9), (0.8, 3, 1 + 0.8 + 0.64 + 0.512)])
def test_expected_tokens_is_the_geometric_sum(alpha, k, expected):
    assert expected_tokens(alpha, k) == pytest.approx(expected)


def test_best_k_maximises_tokens_per_unit_cost():
    for alpha in ALPHAS:
        for c in COSTS:
            rates = [expected_tokens(alpha, k) / (1 + k * c) for k in range(9)]
            k = best_k(alpha, c, 8)
            assert rates[k] == pytest.approx(max(rates)), (alpha, c)
            assert all(r < rates[k] * (1 + 1e-6) for r in rates[:k]), "ties go to the smaller k"


@pytest.mark.parametrize("c", COSTS)
def test_best_k_is_zero_when_drafts_are_never_accepted(c):
    assert best_k(0.0, c, 8) == 0


def test_best_k_grows_with_alpha():
    for c in (0.01, 0.1, 0.3):
        ks = [best_k(a, c, 8) for a in ALPHAS]
        assert ks == sorted(ks)
        assert ks[0] == 0 and ks[-1] == 8


def test_best_k_shrinks_with_the_cost_ratio():
    for alpha in (0.5, 0.8, 0.95):
        ks = [best_k(alpha, c, 8) for c in COSTS[1:]]
        assert ks == sorted(ks, reverse=True)
        assert ks[0] > 0 and ks[-1] == 0  # speculation stops where a draft costs as much as a step


def test_best_k_never_exceeds_k_max():
    assert best_k(0.99, 0.001, 3) == 3
    assert best_k(0.99, 0.001, 0) == 0


def test_linear_cost_recovers_intercept_and_slope_from_noiseless_data():
    cost = LinearCost()
    for _ in range(3):
        for n in (1, 2, 4, 8, 16, 32):
            cost.observe(n, 0.012 + 0.0005 * n)
    a, b = cost.coefficients()
    assert a == pytest.approx(0.012, rel=1e-6)
    assert b == pytest.approx(0.0005, rel=1e-6)
    assert cost(10) == pytest.approx(0.017, rel=1e-6)


def test_linear_cost_without_spread_in_tokens_is_the_mean():
    cost = LinearCost()
    for t in (1.0, 2.0, 3.0):
        cost.observe(4, t)
    a, b = cost.coefficients()
    assert b == 0.0
    assert a == pytest.approx(sum(0.98 ** (2 - i) * t for i, t in enumerate((1.0, 2.0, 3.0))) / (1 + 0.98 + 0.98**2))


def test_linear_cost_clamps_a_negative_slope_to_zero():
    cost = LinearCost()
    for n in (1, 2, 3, 4):
        cost.observe(n, 1.0 - 0.1 * n)
    a, b = cost.coefficients()
    assert b == 0.0 and a >= 0.0


def test_linear_cost_forgets_an_old_regime():
    cost = LinearCost(decay=0.9)
    for n in (1, 2, 4, 8) * 5:
        cost.observe(n, 1.0 + 1.0 * n)
    for n in (1, 2, 4, 8) * 100:
        cost.observe(n, 0.5 + 0.1 * n)
    a, b = cost.coefficients()
    assert a == pytest.approx(0.5, rel=1e-3) and b == pytest.approx(0.1, rel=1e-3)


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


def make_policy(probe_interval=4):
    policy = AdaptivePolicy(k_max=4, probe_interval=probe_interval)
    for n in range(1, 9):  # target: 1 s + 0.01 s per token; draft: 0.05 s per token -> c ~ 0.06
        policy.target_cost.observe(n, 1.0 + 0.01 * n)
        policy.draft_cost.observe(n, 0.05 * n)
    return policy


def test_cost_ratio_is_marginal_draft_cost_over_the_per_sequence_step_cost():
    policy = make_policy()
    assert policy.cost_ratio(1) == pytest.approx((0.01 + 0.05) / 1.01)
    assert policy.cost_ratio(8) == pytest.approx((0.01 + 0.05) / (1.08 / 8))
    assert policy.cost_ratio(8) > policy.cost_ratio(1)  # bigger batches make drafts relatively dearer


def test_cost_ratio_kept_for_a_step_follows_every_new_cost_observation():
    """Asked once per sequence per step, the ratio is cached; a new cost observation or batch size must show."""
    policy = make_policy()
    before = policy.cost_ratio(8)
    assert policy.cost_ratio(8) == before
    assert policy.cost_ratio(1) == pytest.approx((0.01 + 0.05) / 1.01)  # another batch size: not the cached one
    assert policy.cost_ratio(8) == before
    policy.draft_cost.observe(8, 8.0)  # drafts become far dearer
    assert policy.cost_ratio(8) > before
    after = policy.cost_ratio(8)
    policy.target_cost.observe(8, 100.0)  # and the target dearer still
    assert policy.cost_ratio(8) < after


def test_policy_speculates_when_drafts_are_cheap_and_often_accepted():
    r = SourceTrack()
    policy = make_policy()
    for _ in range(10):
        policy.observe(r, 4, 4)
    assert policy.choose(r, batch=1) == 4


def test_policy_probes_with_one_draft_every_probe_interval_once_k_settled_to_zero():
    r = SourceTrack()
    policy = make_policy(probe_interval=4)
    assert policy.choose(r, batch=1) > 0
    for _ in range(10):
        policy.observe(r, 4, 0)  # nothing is ever accepted
    ks = [policy.choose(r, batch=1) for _ in range(12)]
    assert ks == [0, 0, 0, 1] * 3


def test_probe_that_succeeds_brings_speculation_back():
    r = SourceTrack()
    policy = make_policy(probe_interval=4)
    for _ in range(10):
        policy.observe(r, 4, 0)
    assert policy.choose(r, 1) == 0
    for _ in range(10):
        policy.observe(r, 1, 1)  # the drafter started to agree
    assert policy.choose(r, 1) > 0


def test_untrained_policy_does_not_speculate_but_still_probes():
    x = SourceTrack()
    policy = AdaptivePolicy(k_max=4, probe_interval=3)
    assert [policy.choose(x, 1) for _ in range(6)] == [0, 0, 1, 0, 0, 1]


def test_observing_zero_drafts_changes_nothing():
    r = SourceTrack()
    policy = make_policy()
    before = policy.alpha(r)
    policy.observe(r, 0, 0)
    assert policy.alpha(r) == before
    assert policy.global_alpha.trials == 0


def test_failed_probes_back_off_exponentially_and_an_accepted_probe_resets():
    from engine.speculative.adaptive import AdaptivePolicy
    r = SourceTrack()

    policy = AdaptivePolicy(k_max=4, probe_interval=4, max_probe_interval=16)
    policy.target_cost.observe(1, 1.0)
    policy.draft_cost.observe(1, 5.0)  # drafting never pays: only probes draft

    def probe_steps(n):
        steps = []
        for i in range(n):
            k = policy.choose(r, batch=1)
            if k:
                steps.append(i)
                policy.observe(r, k, accepted=0)
        return steps

    steps = probe_steps(60)
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    assert steps[0] == 3 and gaps[:3] == [8, 16, 16]  # 4, then doubled to 8, 16, capped at 16
    policy.observe(r, 1, accepted=1)  # a regular observation that accepted: back to the base interval
    nxt = probe_steps(10)
    assert nxt and nxt[0] == 3


def test_rate_is_the_expected_tokens_per_step_cost_at_the_best_k_and_has_no_side_effects():
    r = SourceTrack()
    policy = make_policy()
    for _ in range(10):
        policy.observe(r, 4, 2)
    alpha, c = policy.alpha(r), policy.cost_ratio(1)
    k = best_k(alpha, c, 4)
    assert policy.rate(r, batch=1) == pytest.approx(expected_tokens(alpha, k) / (1 + k * c))
    assert policy.rate(r, 1, k_max=1) == pytest.approx(expected_tokens(alpha, 1) / (1 + c))
    assert policy.rate(SourceTrack(), 1) >= 1.0, "k = 0 (rate 1) is always an option"
    assert policy.choose(r, 1, k_max=2) == min(k, 2), "a short lookup match caps k"


def test_a_finished_requests_history_leaves_with_its_track():
    policy = make_policy()
    r = SourceTrack()
    for _ in range(10):
        policy.observe(r, 4, 0)
    assert policy.alpha(r) < policy.alpha(SourceTrack()), "a fresh track starts at the prior"
