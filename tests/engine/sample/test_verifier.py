"""engine.sample.verifier: the greedy fast path (one reduction, acceptance on the host) against the
tensor path every other step takes, and which steps take which."""

from __future__ import annotations

import pytest
import torch

from engine.sample.verifier import Verifier
from engine.sample.verify import greedy_accepted
from engine.types.sampling_params import SamplingParams
from engine.types.sequence import Sequence

V = 50
EOS = (0,)


def seqs_and_drafts(gen: torch.Generator, logits: torch.Tensor, ks: list[int], params: SamplingParams):
    """Sequences with ``ks[b]`` drafts each: each draft equal to the target's argmax at its row until a random
    point, then a wrong token (so every accept length from 0 to k occurs)."""
    choice, seqs, drafts, row = logits.argmax(-1).tolist(), [], [], 0
    for b, k in enumerate(ks):
        good = int(torch.randint(0, k + 1, (1,), generator=gen))
        drafts.append([choice[row + j] if j < good else (choice[row + j] + 1) % V for j in range(k)])
        seqs.append(Sequence(f"r{b}", [1, 2, 3], params))
        row += k + 1
    return seqs, drafts


def test_greedy_accepted_is_the_prefix_equal_to_the_choices():
    assert greedy_accepted([5, 6, 7], [5, 6, 7, 8]) == 3
    assert greedy_accepted([5, 6, 7], [5, 9, 7, 8]) == 1
    assert greedy_accepted([5], [4, 8]) == 0
    assert greedy_accepted([], [8]) == 0


@pytest.mark.parametrize("ks", [[0], [4], [3, 0, 5, 1], [2] * 8])
def test_the_greedy_fast_path_gives_the_verdicts_of_the_tensor_path(ks):
    gen = torch.Generator().manual_seed(sum(ks) + len(ks))
    verifier = Verifier(EOS)
    for _ in range(20):
        logits = torch.randn(sum(ks) + len(ks), V, generator=gen)
        seqs, drafts = seqs_and_drafts(gen, logits, ks, SamplingParams(temperature=0.0))
        fast = verifier(seqs, drafts, None, logits)
        assert fast == verifier._verify(seqs, drafts, None, logits)
        assert {v.num_accepted for v in fast} <= set(range(max(ks) + 1))


def test_non_finite_rows_fail_only_their_own_sequence_on_the_fast_path():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(9, V, generator=gen)
    seqs, drafts = seqs_and_drafts(gen, logits, [2, 2, 2], SamplingParams(temperature=0.0))
    logits[4, 7] = float("nan")  # sequence 1's second row
    logits[6:9] = float("-inf")  # sequence 2: nothing finite
    got = Verifier(EOS)(seqs, drafts, None, logits)
    assert [v.error is not None for v in got] == [False, True, True]
    assert got[0] == Verifier(EOS)._verify(seqs[:1], drafts[:1], None, logits[:3])[0]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.0, logit_bias={3: 5.0}),
        SamplingParams(temperature=0.0, presence_penalty=0.5),
        SamplingParams(temperature=0.0, min_tokens=4),
        SamplingParams(temperature=1.0, seed=7),
    ],
    ids=["logprobs", "logit_bias", "penalty", "min_tokens", "seeded"],
)
def test_steps_that_transform_or_report_the_logits_take_the_tensor_path(params, monkeypatch):
    verifier, taken = Verifier(EOS), []
    monkeypatch.setattr(verifier, "_greedy", lambda *a: taken.append("fast"))
    logits = torch.randn(3, V)
    seqs, drafts = seqs_and_drafts(torch.Generator().manual_seed(0), logits, [2], params)
    verdicts = verifier(seqs, drafts, None, logits)
    assert not taken and len(verdicts) == 1 and verdicts[0].error is None
