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
