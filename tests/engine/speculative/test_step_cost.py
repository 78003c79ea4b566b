"""The step-cost model: the online linear fits, the target's profile and its online corrections."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.speculative.step_cost import HostCost, LinearCost, StepCostModel, TargetCost


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


def profile(n, context):
    """A CPU-like forward: 2 and 3 tokens dearer than 5 (other matmul kernels), then linear."""
    bump = {2: 0.003, 3: 0.004}.get(n, 0.0)
    return 0.008 + bump + (0.0003 * n if n > 1 else 0.0) + 0.0005 * context


PROFILE = [(n, n * 0.02, profile(n, n * 0.02)) for n in (1, 2, 3, 5, 9, 18, 36)]
PROFILE += [(n, n * 0.26, profile(n, n * 0.26)) for n in (1, 9)]


def test_the_profile_is_priced_exactly_at_its_sizes_and_between_them_linearly():
    cost = TargetCost()
    cost.set_profile(PROFILE)
    assert cost.curves[True].w == pytest.approx(0.0005)
    for n, context, seconds in PROFILE:
        assert cost(n, context) == pytest.approx(seconds)
    assert cost(4, 0.0) == pytest.approx((profile(3, 0) + profile(5, 0)) / 2)
    assert cost(72, 0.0) == pytest.approx(profile(72, 0)), "past the largest size, along the last segment"
    assert cost.per_token(np.array([2000.0]))[0] == pytest.approx(0.001), "one more token at 2k context"


def test_the_secant_prices_half_and_all_of_the_drafts_exactly_and_extra_prices_any():
    cost = TargetCost()
    cost.set_profile(PROFILE)
    plain, jump, per_token = cost.linearize(1, 0.0, 8)
    assert plain == pytest.approx(profile(1, 0))
    assert plain + jump + 4 * per_token == pytest.approx(profile(5, 0)), "four drafts"
    assert plain + jump + 8 * per_token == pytest.approx(profile(9, 0)), "eight drafts"
    assert cost.extra(1, 0.0, 1) == pytest.approx(profile(2, 0) - profile(1, 0)), "the bump at two tokens"
    assert cost.extra(1, 0.0, 0) == 0.0


def test_many_sizes_at_once_are_priced_as_one_at_a_time():
    cost = TargetCost()
    cost.set_profile(PROFILE)
    for _ in range(50):
        cost.observe(3, 0.2, 0.7 * profile(3, 0.2), True)  # a size's own correction, and the scale, move
    tokens = np.array([1.0, 2.0, 2.5, 4.0, 9.0, 36.0, 72.0, 200.0])
    for verify in (False, True):
        want = [cost(n, 0.3, verify) for n in tokens]
        assert cost.many(tokens, 0.3, verify) == pytest.approx(want, rel=1e-12)


def test_the_profile_follows_a_faster_forward_at_sizes_the_steps_do_not_feed():
    """Eager first, then the compiled forward lands (every size twice as fast); the steps feed 32 tokens only,
    and the verify sizes (40 and more) follow anyway, by the one scale."""
    cost = TargetCost()
    cost.set_profile(PROFILE)
    for _ in range(300):
        cost.observe(36, 0.0, 0.5 * profile(36, 0.0))
    assert cost(36, 0.0) == pytest.approx(0.5 * profile(36, 0.0), rel=0.01)
    assert cost(18, 0.0) == pytest.approx(0.5 * profile(18, 0.0), rel=0.05)


def test_a_size_with_its_own_error_learns_it_without_moving_the_others():
    cost = TargetCost()
    cost.set_profile(PROFILE)
    for _ in range(300):
        cost.observe(36, 0.0, profile(36, 0.0))
        cost.observe(2, 0.0, 0.5 * profile(2, 0.0))  # the profile overrated 2 tokens
    assert cost(2, 0.0) == pytest.approx(0.5 * profile(2, 0.0), rel=0.02)
    assert cost(36, 0.0) == pytest.approx(profile(36, 0.0), rel=0.05)


def test_the_host_work_of_each_source_is_told_apart_in_steps_that_mix_them():
    host, rng = HostCost(), random.Random(0)
    for _ in range(300):
        counts = {"draft_model": rng.randint(0, 16), "suffix": rng.randint(0, 16)}
        host.observe(counts, 1e-3 + 6e-5 * counts["draft_model"] + 2e-5 * counts["suffix"] + rng.gauss(0, 2e-5))
    a, by_source = host.coefficients()
    assert a == pytest.approx(1e-3, rel=0.05)
    assert by_source["draft_model"] == pytest.approx(6e-5, rel=0.05)
    assert by_source["suffix"] == pytest.approx(2e-5, rel=0.1)
    pooled = host.pooled.coefficients()[1]
    assert 2e-5 < pooled < 6e-5, "the pooled fit sits between them"
    assert host.per_sequence("ngram") == pooled, "a source never seen: priced at the pooled fit"


def test_parameters_name_every_term():
    model = StepCostModel(["draft_model"])
    assert set(model.parameters()) == {
        "target_decode_1_tokens", "target_decode_2_tokens", "target_verify_1_tokens", "target_verify_2_tokens",
        "target_per_token_per_1k_context",
        "draft_model_per_forward", "draft_model_per_token", "draft_model_catch_up_per_forward",
        "draft_model_catch_up_per_token", "lookup_per_step", "lookup_per_sequence",
        "host_per_step", "host_per_sequence",
    }
    model.host.observe({"suffix": 2}, 1e-4)
    assert "host_per_sequence_suffix" in model.parameters()


def test_a_plain_step_is_priced_on_the_decode_layout_and_drafts_on_the_verify_one():
    """A compiled decode graph at 32 sequences is far cheaper than a verify layout of as many tokens: the gap is
    what speculating pays first, and each layout learns from its own steps."""
    cost = TargetCost()
    cost.set_profile([(n, 0.0, 0.004 + 1e-4 * n, False) for n in (1, 8, 32, 64)]
                     + [(n, 0.0, 0.009 + 1e-4 * n, True) for n in (2, 9, 36, 72)])
    assert cost(32, 0.0) == pytest.approx(0.0072)
    assert cost.extra(32, 0.0, 8) == pytest.approx(0.009 + 40e-4 - 0.0072), "the verify layout's jump and tokens"
    plain, jump, per_token = cost.linearize(32, 0.0, 8)
    assert plain == pytest.approx(0.0072) and jump + 8 * per_token == pytest.approx(cost.extra(32, 0.0, 8))
    for _ in range(300):
        cost.observe(32, 0.0, 0.0072)  # the decode as profiled
        cost.observe(40, 0.0, 2 * (0.009 + 40e-4), verify=True)  # verify steps twice as dear as profiled
    assert cost(32, 0.0) == pytest.approx(0.0072, rel=0.05)
    assert cost(40, 0.0, verify=True) == pytest.approx(2 * (0.009 + 40e-4), rel=0.05)



def test_a_noisy_short_pair_does_not_set_the_context_cost():
    """One decode token at two contexts differs by timing noise alone; the widest pair (a full verify at both)
    sets the cost of context, so a 64-sequence decode is not priced at nothing."""
    points = [(b, b * 0.017, 0.004 + 5e-5 * b, False) for b in (1, 2, 4, 8, 16, 32, 64)]
    points += [(1, 0.257, 0.005, False)]  # +1 ms of noise over a context 0.24 k-tokens longer
    points += [(9, 9 * 0.025, 0.006, True), (9, 9 * 0.265, 0.0062, True)]
    cost = TargetCost()
    cost.set_profile(points)
    assert cost.curves[False].w == pytest.approx(0.0002 / (9 * 0.24))
    assert cost(64, 64 * 0.017) == pytest.approx(0.004 + 5e-5 * 64, rel=0.01)
