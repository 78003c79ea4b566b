"""Logits -> distributions, and the exponential-race sampler. Pure tensor tests on CPU."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from engine.sample.sampling import (
    RowSpec,
    argmax_rows,
    logprobs_of,
    probs_from_logits,
    process_logits,
    row_spec,
    sample_from,
)
from engine.types.sampling_params import SamplingParams
from engine.types.sequence import Sequence

CPU = torch.device("cpu")

P4 = [0.5, 0.3, 0.15, 0.05]


def logits_of(probs):
    return torch.tensor([probs]).log()


def kept(probs_row):
    return (probs_row > 0).nonzero().flatten().tolist()


# ---- argmax --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_argmax_rows_is_torch_argmax_first_maximum_and_nan_included(dtype):
    """numpy's argmax serves the CPU: it must pick what torch's does, ties and NaN rows included, so greedy
    outputs do not depend on which library read the logits."""
    x = torch.randn(6, 50, dtype=dtype)
    x[1, 3] = x[1, 40] = 9.0  # a tie: the first maximum
    x[2, 7] = x[2, 11] = float("nan")  # NaN counts as the maximum, the first one
    x[3] = float("-inf")  # nothing finite: index 0
    x[4, 30] = float("inf")
    x[5, :] = 1.0  # all equal
    got = argmax_rows(x)
    assert got.dtype == torch.long
    assert got.tolist() == x.argmax(dim=-1).tolist() == [int(x[0].argmax()), 3, 7, 0, 30, 0]
    batched = torch.randn(3, 4, 20, dtype=dtype)
    assert torch.equal(argmax_rows(batched), batched.argmax(dim=-1))
    strided = x.t().contiguous().t()  # a non-contiguous view of the same values
    assert argmax_rows(strided).tolist() == got.tolist()


def test_argmax_rows_of_bf16_logits_takes_torch_own():
    x = torch.randn(3, 40).to(torch.bfloat16)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


# ---- temperature and truncation -----------------------------------------------------------------


def test_temperature_divides_the_logits_before_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    for t in (0.5, 1.0, 1.7):
        probs = probs_from_logits(logits, [SamplingParams(temperature=t)])
        torch.testing.assert_close(probs, torch.softmax(logits / t, dim=-1))
    hot = probs_from_logits(logits, [SamplingParams(temperature=2.0)])
    cold = probs_from_logits(logits, [SamplingParams(temperature=0.25)])
    assert cold[0, 0] > hot[0, 0]


def test_greedy_rows_get_an_untempered_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    torch.testing.assert_close(probs_from_logits(logits, [SamplingParams(temperature=0.0)]), torch.softmax(logits, -1))


def test_each_row_uses_its_own_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    probs = probs_from_logits(logits, [SamplingParams(temperature=0.5), SamplingParams(temperature=1.5)])
    torch.testing.assert_close(probs[0], torch.softmax(logits[0] / 0.5, -1))
    torch.testing.assert_close(probs[1], torch.softmax(logits[1] / 1.5, -1))


def test_top_k_keeps_the_k_most_likely_tokens_renormalised():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    probs = probs_from_logits(logits, [SamplingParams(top_k=2)])
    assert kept(probs[0]) == [1, 3]
    full = torch.softmax(logits[0], -1)
    torch.testing.assert_close(probs[0, [1, 3]], full[[1, 3]] / full[[1, 3]].sum())
    assert probs.sum().item() == pytest.approx(1.0)


def test_top_k_larger_than_the_vocabulary_keeps_everything():
    logits = logits_of(P4)
    torch.testing.assert_close(probs_from_logits(logits, [SamplingParams(top_k=50)]), torch.tensor([P4]))


@pytest.mark.parametrize(("top_p", "expected"), [(0.7, [0, 1]), (0.85, [0, 1, 2]), (0.96, [0, 1, 2, 3]), (0.4, [0])])
def test_top_p_keeps_the_smallest_prefix_reaching_the_mass(top_p, expected):
    probs = probs_from_logits(logits_of(P4), [SamplingParams(top_p=top_p)])
    assert kept(probs[0]) == expected
    mass = sum(P4[i] for i in expected)
    torch.testing.assert_close(probs[0, expected], torch.tensor([P4[i] / mass for i in expected]))


def test_top_p_always_keeps_the_most_likely_token_even_below_its_mass():
    probs = probs_from_logits(logits_of([0.2, 0.3, 0.25, 0.25]), [SamplingParams(top_p=1e-6)])
    assert kept(probs[0]) == [1]
    assert probs[0, 1].item() == pytest.approx(1.0)


def test_top_p_does_not_depend_on_token_order():
    perm = [2, 0, 3, 1]
    shuffled = [P4[i] for i in perm]
    probs = probs_from_logits(logits_of(shuffled), [SamplingParams(top_p=0.7)])
    # Tokens with p = 0.5 and 0.3 sit at positions 1 and 3 now.
    assert kept(probs[0]) == [1, 3]


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability():
    probs = probs_from_logits(logits_of(P4), [SamplingParams(min_p=0.2)])  # threshold 0.1
    assert kept(probs[0]) == [0, 1, 2]
    probs = probs_from_logits(logits_of(P4), [SamplingParams(min_p=0.7)])  # threshold 0.35
    assert kept(probs[0]) == [0]


def test_top_k_top_p_and_min_p_combine_as_an_intersection():
    probs = probs_from_logits(logits_of(P4), [SamplingParams(top_k=3, top_p=0.96, min_p=0.2)])
    assert kept(probs[0]) == [0, 1, 2]
    probs = probs_from_logits(logits_of(P4), [SamplingParams(top_k=3, top_p=0.7, min_p=0.01)])
    assert kept(probs[0]) == [0, 1]


def test_truncation_in_one_row_leaves_other_rows_untouched():
    logits = torch.cat([logits_of(P4), logits_of([0.1, 0.2, 0.3, 0.4])])
    probs = probs_from_logits(logits, [SamplingParams(top_k=1), SamplingParams(temperature=0.8)])
    assert kept(probs[0]) == [0]
    torch.testing.assert_close(probs[1], torch.softmax(logits[1] / 0.8, -1))


def test_untruncated_row_keeps_every_token_of_a_large_vocabulary_in_a_mixed_batch():
    # A request without top-k/top-p/min-p must sample from the full softmax even when another row
    # of the batch truncates. With 32k tokens, the float32 cumulative sum reaches 1.0 before the
    # tail, so a "mass before < top_p = 1.0" test would drop real (tiny) probabilities.
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 32000, generator=g) * 3
    probs = probs_from_logits(logits, [SamplingParams(top_k=2), SamplingParams()])
    assert int((probs[1] == 0).sum()) == 0
    torch.testing.assert_close(probs[1], torch.softmax(logits[1], -1))


# ---- penalties, bias, bans ----------------------------------------------------------------------


def test_presence_and_frequency_penalties_follow_openai_formula():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    params = SamplingParams(presence_penalty=0.25, frequency_penalty=0.5)
    out = process_logits(logits, [RowSpec(params, output_tokens=[1, 1, 2, 1, 4])])
    # logit -= frequency * count + presence * (count > 0)
    counts = [0, 3, 1, 0, 1, 0]
    expected = [v - 0.5 * c - 0.25 * (c > 0) for v, c in zip(logits[0].tolist(), counts, strict=True)]
    torch.testing.assert_close(out, torch.tensor([expected]))


def test_negative_penalties_encourage_repetition():
    logits = torch.zeros(1, 4)
    params = SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5)
    out = process_logits(logits, [RowSpec(params, output_tokens=[2, 2])])
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 2.0, 0.0]]))


def test_penalties_apply_only_to_rows_that_ask_for_them():
    logits = torch.zeros(2, 4)
    rows = [
        RowSpec(SamplingParams(frequency_penalty=1.0), output_tokens=[3]),
        RowSpec(SamplingParams(), output_tokens=[3]),
    ]
    out = process_logits(logits, rows)
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]]))


def test_logit_bias_is_added_to_the_named_tokens():
    logits = torch.tensor([[1.0, 1.0, 1.0]])
    out = process_logits(logits, [RowSpec(SamplingParams(logit_bias={0: -100.0, 2: 3.5}), output_tokens=())])
    torch.testing.assert_close(out, torch.tensor([[-99.0, 1.0, 4.5]]))


def test_banned_tokens_get_minus_infinity_and_zero_probability():
    logits = torch.tensor([[5.0, 1.0, 1.0, 0.0]])
    out = process_logits(logits, [RowSpec(SamplingParams(logit_bias={0: 10.0}), output_tokens=(), banned=(0, 3))])
    assert out[0, 0].item() == -math.inf and out[0, 3].item() == -math.inf
    assert out[0, 1].item() == 1.0
    probs = probs_from_logits(out, [SamplingParams()])
    assert probs[0, 0].item() == 0.0 and probs[0, 3].item() == 0.0
    assert probs[0, 1].item() == pytest.approx(0.5)


def test_process_logits_never_modifies_its_input():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    before = logits.clone()
    rows = [RowSpec(SamplingParams(frequency_penalty=1.0, logit_bias={1: 2.0}), output_tokens=[2], banned=(0,))]
    process_logits(logits, rows)
    torch.testing.assert_close(logits, before)


def test_row_spec_bans_eos_and_stop_token_ids_until_min_tokens():
    params = SamplingParams(min_tokens=3, stop_token_ids=[9], presence_penalty=0.5)
    seq = Sequence("r", [1, 2, 3, 4], params, num_prompt_tokens=2)  # two tokens generated
    assert set(row_spec(seq, [], [0], 10, CPU).banned) == {0, 9}
    spec = row_spec(seq, [7], [0], 10, CPU)  # the row after one draft: three generated, may end
    assert spec.banned == ()
    assert list(spec.output_tokens) == [7] and spec.counts is not None  # the draft; 3 and 4 are counted
    assert spec.counts.tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 0, 0]
    ignore = Sequence("r", [1, 2], SamplingParams(min_tokens=3, ignore_eos=True, stop_token_ids=[9]))
    assert list(row_spec(ignore, [], [0], 10, CPU).banned) == [9]


def test_penalty_counts_are_kept_on_the_sequence_and_grow_by_the_new_tokens_only():
    params = SamplingParams(frequency_penalty=0.5)
    seq = Sequence("r", [1, 2], params)
    rnd = random.Random(3)
    for _ in range(6):
        seq.token_ids.extend(rnd.randrange(12) for _ in range(rnd.randrange(1, 5)))  # a step's tokens
        counts = row_spec(seq, [], [0], 8, CPU).counts  # ids past the vocabulary count as its last id
        want = torch.bincount(torch.tensor([min(t, 7) for t in seq.output_token_ids]), minlength=8).float()
        torch.testing.assert_close(counts, want)
    assert row_spec(seq, [], [0], 8, CPU).counts is counts, "the same tensor, updated in place"
    # Penalised rows read the kept counts plus their own drafts: the same logits as counting from scratch.
    logits = torch.randn(2, 8)
    kept = process_logits(logits, [row_spec(seq, [5], [0], 8, CPU), RowSpec(SamplingParams(), ())])
    scratch = process_logits(logits, [RowSpec(params, [*seq.output_token_ids, 5]), RowSpec(SamplingParams(), ())])
    torch.testing.assert_close(kept, scratch)


# ---- sampling -----------------------------------------------------------------------------------


def test_exponential_race_samples_from_p():
    torch.manual_seed(1234)
    p = torch.tensor([0.05, 0.1, 0.15, 0.2, 0.22, 0.28])
    n = 20000
    noise = torch.empty(n, 6).exponential_()
    tokens = sample_from(p.expand(n, 6), noise)
    counts = torch.bincount(tokens, minlength=6).numpy()
    expected = p.double().numpy()
    assert chisquare(counts, expected / expected.sum() * n).pvalue > 1e-3
    # A wrong distribution is rejected by the same test: the check has power.
    assert chisquare(counts, np.full(6, n / 6)).pvalue < 1e-6


def test_exponential_race_needs_no_normalisation_and_never_picks_zero_probability():
    torch.manual_seed(7)
    p = torch.tensor([[0.0, 0.2, 0.0, 0.8]]).expand(5000, 4)
    noise = torch.empty(5000, 4).exponential_()
    tokens = sample_from(p, noise)
    assert torch.equal(tokens, sample_from(p * 37.0, noise))
    assert set(tokens.tolist()) == {1, 3}


def test_logprobs_are_those_of_the_raw_logits():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    chosen, top_v, top_i = logprobs_of(logits, torch.tensor([2]), 2)
    logp = torch.log_softmax(logits, -1)
    assert chosen.item() == pytest.approx(logp[0, 2].item())
    assert top_i.tolist() == [[1, 2]]
    torch.testing.assert_close(top_v, logp[:, [1, 2]])
    _, none_v, none_i = logprobs_of(logits, torch.tensor([2]), 0)
    assert none_v.shape == (1, 0) and none_i.shape == (1, 0)
