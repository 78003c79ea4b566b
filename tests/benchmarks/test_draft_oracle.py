"""benchmarks/draft_oracle.py: a proposal's agreed length, and the hindsight plan against brute force."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest


def test_a_proposal_agrees_up_to_its_first_token_the_output_does_not_hold():
    from benchmarks.draft_oracle import agreed

    assert agreed([1, 2, 3], [1, 2, 4, 5]) == 2
    assert agreed([1, 2], [1, 2, 3]) == 2
    assert agreed([1, 2, 3], [1, 2]) == 2, "the output ended: nothing past it holds"
    assert agreed([], [1]) == 0
    assert agreed([7], [1]) == 0


def test_the_hindsight_rate_is_the_best_over_every_choice_of_k():
    from benchmarks.draft_oracle import best_rate

    rng = random.Random(0)
    for case in range(30):
        n, k = rng.randint(1, 4), rng.randint(1, 3)
        held = [rng.randint(0, k) for _ in range(n)]
        accepted = np.array([[min(j, h) for j in range(k + 1)] for h in held], dtype=float)
        seconds = np.array([[1.0 + j * rng.uniform(0.05, 0.8) for j in range(k + 1)] for _ in range(n)])
        rate, pick = best_rate(accepted, seconds, seconds[:, 0])
        best = max(sum(1 + accepted[i, c] for i, c in enumerate(ks)) / sum(seconds[i, c] for i, c in enumerate(ks))
                   for ks in itertools.product(range(k + 1), repeat=n))
        assert rate == pytest.approx(best, rel=1e-9), case
        rows = np.arange(n)
        assert (1 + accepted[rows, pick]).sum() / seconds[rows, pick].sum() == pytest.approx(rate), case


def test_hindsight_takes_the_longest_agreeing_source_and_never_beats_free_drafts():
    from benchmarks.draft_oracle import hindsight
    from engine.speculative.step_cost import TargetCost

    cost = TargetCost()
    cost.set_profile([(1, 0.0, 1e-3), (2, 0.0, 1.2e-3), (9, 0.0, 2e-3), (25, 0.0, 4e-3)])
    steps = [{"context": 64, "agreed": {"ngram": 3, "suffix": 12}}, {"context": 80, "agreed": {"ngram": 0}}]
    within_8, within_24 = hindsight(steps, 8, cost), hindsight(steps, 24, cost)
    assert within_8["k_max"] == 8 and within_24["k_max"] == 24
    assert within_24["tokens_per_step"] >= within_8["tokens_per_step"] > 1.0
    assert within_24["speedup_bound"] >= within_8["speedup_bound"] > 1.0
    nothing = hindsight([{"context": 64, "agreed": {"ngram": 0}}], 8, cost)
    assert nothing["speedup_bound"] == pytest.approx(1.0) and nothing["mean_k"] == 0.0


def test_lockstep_keeps_n_slots_busy_and_a_slot_takes_the_next_request_when_its_own_ends():
    from benchmarks.draft_oracle import lockstep

    steps = [{"request": r, "i": i} for r, n in enumerate([2, 1, 1, 3]) for i in range(n)]
    batches = lockstep(steps, 2)
    assert [[(s["request"], s["i"]) for s in b] for b in batches] == [
        [(0, 0), (1, 0)], [(0, 1), (2, 0)], [(3, 0)], [(3, 1)], [(3, 2)]]
    assert [s for b in lockstep(steps, 1) for s in b] == steps, "one slot: the run at 1 as it was"
    assert sum(map(len, lockstep(steps, 8))) == len(steps)


def _profile():
    from engine.speculative.step_cost import TargetCost

    cost = TargetCost()
    cost.set_profile([(1, 0.0, 1e-3), (2, 0.0, 1.2e-3), (4, 0.0, 1.5e-3), (8, 0.0, 2.2e-3), (16, 0.0, 3.5e-3)])
    return cost


def test_the_batched_bound_at_one_is_the_bound_at_one():
    from benchmarks.draft_oracle import batched_hindsight, hindsight

    rng = random.Random(1)
    steps = [{"request": r, "context": 30 + 7 * i, "agreed": {"ngram": rng.randint(0, 5), "suffix": rng.randint(0, 9)}}
             for r in range(3) for i in range(4)]
    cost = _profile()
    for k in (3, 8):
        assert batched_hindsight(steps, 1, k, cost)["speedup_bound"] == pytest.approx(
            hindsight(steps, k, cost)["speedup_bound"], rel=1e-9)


def test_the_batched_bound_is_the_best_over_every_sequences_every_choice_of_k():
    from benchmarks.draft_oracle import batched_hindsight, lockstep

    cost = _profile()  # no context term: a batch step's price is its tokens' alone
    rng = random.Random(2)
    for case in range(12):
        k = rng.randint(1, 3)
        steps = [{"request": r, "context": 0, "agreed": {"suffix": rng.randint(0, k + 1)}}
                 for r, n in enumerate([rng.randint(1, 2) for _ in range(3)]) for _ in range(n)]
        batches = lockstep(steps, 2)
        plain = sum(len(b) for b in batches) / sum(cost(len(b), 0.0, False) for b in batches)
        best = 0.0
        choices = [list(itertools.product(range(k + 1), repeat=len(b))) for b in batches]
        for plan in itertools.product(*choices):
            tokens = seconds = 0.0
            for b, ds in zip(batches, plan):
                tokens += sum(1 + min(d, s["agreed"]["suffix"]) for d, s in zip(ds, b))
                seconds += cost(len(b) + sum(ds), 0.0, sum(ds) > 0)
            best = max(best, tokens / seconds)
        assert batched_hindsight(steps, 2, k, cost)["speedup_bound"] == pytest.approx(best / plain, rel=1e-9), case
