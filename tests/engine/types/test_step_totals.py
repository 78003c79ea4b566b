"""StepTotals, the one sum of step stats behind LLM.stats(), the /metrics window and the stats log: its
means follow the metrics docs (mean accepted length is the accepted-length histogram's mean, 0 without
drafts), and a step taken back out leaves the totals as they were."""

from __future__ import annotations

from engine.types.stats import SourceStepStats, StepStats, StepTotals


def step(**kw) -> StepStats:
    base = dict(
        num_scheduled=2, num_prompt_tokens=0, num_generated_tokens=6, num_drafts=2, num_draft_tokens=8,
        num_accepted_tokens=4, accepted_per_position=(2, 1, 1, 0), accepted_lengths=(4, 2), num_decoding=2,
        mean_k=4.0, num_preempted=0, num_running=2, num_waiting=0, kv_usage=0.25, draft_seconds=0.001,
        target_seconds=0.004, step_seconds=0.006,
    )
    return StepStats(**{**base, **kw})


NO_DRAFTS = step(num_generated_tokens=2, num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0,
                 accepted_per_position=(), accepted_lengths=(), mean_k=0.0)


def test_mean_accepted_length_is_the_mean_of_the_accepted_length_histogram():
    totals = StepTotals()
    steps = [step(), step(num_drafts=1, num_draft_tokens=3, num_accepted_tokens=3, accepted_per_position=(1, 1, 1),
                      accepted_lengths=(4,)), NO_DRAFTS]
    for s in steps:
        totals.add(s)
    lengths = [n for s in steps for n in s.accepted_lengths]  # what specd:spec_decode_accepted_length observes
    assert totals.mean_accepted_length == sum(lengths) / len(lengths) == 10 / 3
    assert totals.accepted_per_position == [3, 2, 2, 0]


def test_mean_accepted_length_acceptance_and_k_are_0_without_drafts():
    totals = StepTotals()
    assert (totals.mean_accepted_length, totals.acceptance_rate, totals.mean_k) == (0.0, 0.0, 0.0)
    totals.add(NO_DRAFTS)
    assert totals.mean_accepted_length == 0.0, "no verify step drafted: the histogram has no mean"
    assert totals.acceptance_rate == 0.0 and totals.acceptance_rate_of("draft_model") == 0.0
    assert totals.mean_k == 0.0, "two decoding sequence-steps chose k = 0"


def test_a_step_taken_back_out_leaves_the_totals_as_they_were():
    by_source = (SourceStepStats("draft_model", 1, 4, 1, (1, 0, 0, 0)), SourceStepStats("ngram", 1, 4, 3, (1, 1, 1, 0)))
    totals = StepTotals()
    totals.add(step(num_prompt_tokens=7, prefix_cache_queries=8, prefix_cache_hits=4, by_source=by_source))
    before = totals.copy()
    later = step(num_preempted=1, num_forced_draft_tokens=2, num_forced_accepted_tokens=1, by_source=by_source)
    totals.add(later)
    assert totals != before and totals.by_source["ngram"].num_accepted_tokens == 6
    assert before.by_source["ngram"].num_accepted_tokens == 3, "a copy shares nothing with the totals"
    totals.add(later, sign=-1)
    assert totals == before
    assert totals.num_steps == 1 and totals.num_preempted == 0 and totals.num_forced_draft_tokens == 0
