"""The goodput solver against brute force: every (source, k) per sequence under synthetic costs and acceptance."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import numpy as np
import pytest

from engine.speculative.goodput import Block, solve, solve_one


@dataclass(frozen=True)
class Option:
    """One (sequence, source) option, as the brute force enumerates them."""

    seq: int
    source: str
    gains: tuple[float, ...]
    per_draft: float
    fixed: float
    drafter: int | None = None


def solve_options(num_seqs, plain_seconds, options, drafter_costs, k_max, **kw):
    """The solver over the options gathered into one block per source (a model drafter's gains as wide as its
    cap, ``drafter_k_max``, where one is given)."""
    blocks = []
    for source in dict.fromkeys(o.source for o in options):
        model = any(o.drafter is not None for o in options if o.source == source)
        width = min(k_max, kw.get("drafter_k_max") or k_max) if model else k_max
        gains, caps = np.zeros((num_seqs, width)), np.zeros(num_seqs, dtype=int)
        per_draft, fixed, drafter = np.zeros(num_seqs), np.zeros(num_seqs), None
        for o in (o for o in options if o.source == source):
            cap = min(len(o.gains), width)
            gains[o.seq, :cap], caps[o.seq] = o.gains[:cap], cap
            per_draft[o.seq], fixed[o.seq], drafter = o.per_draft, o.fixed, o.drafter
        blocks.append(Block(source, gains, caps, per_draft, fixed, drafter))
    return solve(num_seqs, plain_seconds, blocks, drafter_costs, k_max, **kw)


def brute_force(num_seqs, plain_seconds, options, drafter_costs, k_max):
    """The best rate over every assignment, and the rate of the plain step."""
    per_seq = [[(None, 0, None)] + [(o, k, o.drafter) for o in options if o.seq == s
                                   for k in range(1, min(k_max, len(o.gains)) + 1)] for s in range(num_seqs)]
    best = num_seqs / plain_seconds
    for combo in itertools.product(*per_seq):
        tokens, seconds, used = float(num_seqs), plain_seconds, [0] * len(drafter_costs)
        for o, k, d in combo:
            if o is None:
                continue
            tokens += sum(o.gains[:k])
            seconds += o.fixed + k * o.per_draft
            if d is not None:
                used[d] = max(used[d], k)
        seconds += sum(u * a for u, a in zip(used, drafter_costs))
        best = max(best, tokens / seconds)
    return best


def geometric(alpha, cap):
    return tuple(alpha ** j for j in range(1, cap + 1))


def random_case(rng, num_seqs, num_drafters, k_max):
    options = []
    for s in range(num_seqs):
        for d in range(num_drafters):
            if rng.random() < 0.8:
                options.append(Option(s, f"model{d}", geometric(rng.random(), k_max), rng.uniform(0.0, 0.3),
                                      rng.uniform(0.0, 0.5), d))
        if rng.random() < 0.6:  # a lookup that proposed a few tokens, acceptance falling faster than geometric
            cap = rng.randint(1, k_max)
            g = sorted((rng.random() for _ in range(cap)), reverse=True)
            options.append(Option(s, "lookup", tuple(g), rng.uniform(0.0, 0.1), rng.uniform(0.0, 0.2)))
    drafter_costs = tuple(rng.uniform(0.0, 1.0) for _ in range(num_drafters))
    return options, drafter_costs


@pytest.mark.parametrize("num_drafters", [0, 1, 2])
def test_the_solver_finds_the_brute_force_optimum(num_drafters):
    rng = random.Random(num_drafters)
    for case in range(60):
        num_seqs, k_max = rng.randint(1, 3), rng.randint(1, 3)
        plain_seconds = rng.uniform(0.2, 3.0)
        options, drafter_costs = random_case(rng, num_seqs, num_drafters, k_max)
        plan = solve_options(num_seqs, plain_seconds, options, drafter_costs, k_max)
        want = brute_force(num_seqs, plain_seconds, options, drafter_costs, k_max)
        assert plan.tokens / plan.seconds == pytest.approx(want, rel=1e-9), case
        assert len(plan.choices) == num_seqs


@pytest.mark.parametrize("num_drafters", [1, 2])
def test_lookups_past_the_model_drafters_cap_get_the_brute_force_optimum(num_drafters):
    """A lookup may take up to k_max drafts while a model drafter stops at drafter_k_max (its forwards are
    enumerated only that far): the plan is still the best over every assignment within those caps."""
    rng = random.Random(10 + num_drafters)
    past = 0
    for case in range(60):
        num_seqs, drafter_k, k_max = rng.randint(1, 3), rng.randint(1, 2), 4
        plain_seconds = rng.uniform(0.2, 3.0)
        options, drafter_costs = random_case(rng, num_seqs, num_drafters, k_max)
        options = [o if o.drafter is None else Option(o.seq, o.source, o.gains[:drafter_k], o.per_draft, o.fixed,
                                                      o.drafter) for o in options]
        plan = solve_options(num_seqs, plain_seconds, options, drafter_costs, k_max, drafter_k_max=drafter_k)
        want = brute_force(num_seqs, plain_seconds, options, drafter_costs, k_max)
        assert plan.tokens / plan.seconds == pytest.approx(want, rel=1e-9), case
        assert all(k <= drafter_k for src, k in plan.choices if src != "lookup"), case
        past += any(src == "lookup" and k > drafter_k for src, k in plan.choices)
    assert past, "no plan gave a lookup more drafts than the model drafters' cap: nothing was shown"


def test_the_plan_it_reports_is_the_plan_it_chose():
    rng = random.Random(7)
    for _ in range(40):
        options, drafter_costs = random_case(rng, 4, 1, 4)
        plan = solve_options(4, 1.0, options, drafter_costs, 4)
        tokens, seconds, used = 4.0, 1.0, 0
        for s, (source, k) in enumerate(plan.choices):
            if not k:
                assert source is None
                continue
            o = next(o for o in options if o.seq == s and o.source == source)
            tokens += sum(o.gains[:k])
            seconds += o.fixed + k * o.per_draft
            if o.drafter is not None:
                used = max(used, k)
        assert plan.tokens == pytest.approx(tokens) and plan.seconds == pytest.approx(seconds + used * drafter_costs[0])


def test_drafts_never_accepted_or_dearer_than_a_step_leave_the_plain_step():
    useless = [Option(0, "m", (0.0, 0.0), 0.01, 0.0, 0)]
    assert not solve_options(1, 1.0, useless, (0.01,), 2).speculates
    dear = [Option(0, "m", (0.9, 0.81), 2.0, 0.0, 0)]
    assert not solve_options(1, 1.0, dear, (0.0,), 2).speculates


def test_a_margin_keeps_the_plain_step_for_a_small_predicted_gain():
    options = [Option(0, "lookup", (0.1,), 0.05, 0.0)]
    plan = solve_options(1, 1.0, options, (), 1)
    assert plan.speculates and plan.speedup == pytest.approx(1.1 / 1.05)
    assert not solve_options(1, 1.0, options, (), 1, margin=0.1).speculates


def switch_off_concurrency(per_token, alpha=0.7, k_max=4):
    """The smallest batch at which a draft model stops paying: target 10 ms + ``per_token`` s per token, a draft
    forward 1 ms + 0.05 ms per token, 0.05 ms of host work per speculating sequence."""
    for n in range(1, 513):
        options = [Option(s, "draft_model", geometric(alpha, k_max), per_token + 5e-5, 5e-5, 0) for s in range(n)]
        if not solve_options(n, 0.010 + per_token * n, options, (0.001,), k_max).speculates:
            return n
    return None


def test_the_switch_off_concurrency_moves_with_the_step_cost():
    cheap, dear = switch_off_concurrency(1e-5), switch_off_concurrency(1e-4)
    assert cheap is not None and dear is not None
    assert dear < cheap, "a dearer marginal token turns speculation off at a smaller batch"
    assert switch_off_concurrency(1e-4, alpha=0.9) > dear, "better acceptance keeps it on for longer"


def test_a_cost_paid_once_by_any_speculating_step_is_priced_in():
    rng = random.Random(11)
    for case in range(40):
        options, drafter_costs = random_case(rng, 2, 1, 2)
        fixed = rng.uniform(0.0, 1.0)
        plan = solve_options(2, 1.0, options, drafter_costs, 2, step_fixed=fixed)
        shifted = [Option(o.seq, o.source, o.gains, o.per_draft, o.fixed, o.drafter) for o in options]
        want = max(2.0, *(brute_force_with_fixed(shifted, drafter_costs, fixed)))
        assert plan.tokens / plan.seconds == pytest.approx(want, rel=1e-9), case


def brute_force_with_fixed(options, drafter_costs, fixed):
    per_seq = [[(None, 0)] + [(o, k) for o in options if o.seq == s for k in range(1, len(o.gains) + 1)]
               for s in range(2)]
    for combo in itertools.product(*per_seq):
        if all(o is None for o, _ in combo):
            continue
        tokens, seconds, used = 2.0, 1.0 + fixed, 0
        for o, k in combo:
            if o is not None:
                tokens += sum(o.gains[:k])
                seconds += o.fixed + k * o.per_draft
                used = max(used, k) if o.drafter is not None else used
        yield tokens / (seconds + used * drafter_costs[0])


def bumpy(rng):
    """A target's extra cost for d more tokens that no line fits: steps and dips, as CPU matmul kernels give."""
    knots = np.arange(0.0, 12.0)
    values = np.concatenate([[0.0], np.cumsum([rng.uniform(-0.05, 0.4) for _ in range(11)])])
    return lambda d: np.interp(d, knots, np.maximum(values, 0.0))


@pytest.mark.parametrize("num_drafters", [0, 1, 2])
def test_a_single_sequence_gets_the_best_source_and_k_priced_on_the_profile_itself(num_drafters):
    rng = random.Random(100 + num_drafters)
    for case in range(80):
        k_max, plain_seconds = rng.randint(1, 8), rng.uniform(0.2, 3.0)
        options, drafter_costs = random_case(rng, 1, num_drafters, k_max)
        extra, step_fixed = bumpy(rng), rng.uniform(0.0, 0.3)
        chance = {o.source: rng.choice([1.0, rng.uniform(0.1, 1.0)]) for o in options}
        blocks = []
        for o in options:
            cap = min(len(o.gains), k_max)
            gains = np.zeros((1, k_max))
            gains[0, :cap] = [chance[o.source] * g for g in o.gains[:cap]]
            blocks.append(Block(o.source, gains, np.array([cap]), np.array([o.per_draft]), np.array([o.fixed]),
                                o.drafter, np.array([chance[o.source]])))
        plan = solve_one(plain_seconds, blocks, drafter_costs, k_max, extra, step_fixed=step_fixed)
        best, want = 1.0 / plain_seconds, ((None, 0),)
        for o in options:
            for k in range(1, min(len(o.gains), k_max) + 1):
                tokens = 1.0 + chance[o.source] * sum(o.gains[:k])
                seconds = (plain_seconds + step_fixed + o.fixed + o.per_draft * k + float(extra(chance[o.source] * k))
                           + (drafter_costs[o.drafter] * k if o.drafter is not None else 0.0))
                if tokens / seconds > best:
                    best, want = tokens / seconds, ((o.source, k),)
        assert plan.tokens / plan.seconds == pytest.approx(best, rel=1e-9), case
        assert plan.choices == want, case


def test_a_single_sequence_plan_within_the_margin_is_plain():
    block = Block("lookup", np.array([[0.1]]), np.array([1]), np.array([0.05]), np.array([0.0]))
    none = lambda d: np.zeros_like(d)  # noqa: E731
    plan = solve_one(1.0, [block], (), 1, none)
    assert plan.speculates and plan.speedup == pytest.approx(1.1 / 1.05)
    assert not solve_one(1.0, [block], (), 1, none, margin=0.1).speculates
    assert not solve_one(1.0, [], (), 1, none).speculates
