"""The draft loop the model-backed sources share (draft model, early exit, EAGLE head): one forward per draft
position over the rows still drafting, each position fed the drafts of the one before, on the device."""

from __future__ import annotations

import pytest
import torch

from engine.speculative.chain import draft_chain
from engine.speculative.source import DraftRequest
from engine.types.config import EngineConfig
from engine.types.sampling_params import SamplingParams
from engine.types.sequence import Sequence

V = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def request(i: int, max_drafts: int) -> DraftRequest:
    return DraftRequest(Sequence(str(i), [1, 2, 3], GREEDY), max_drafts)


class Recorder:
    """A forward whose logits make row i's draft at position j equal to (its previous draft + i + 1) mod V
    (from 0 at j = 0): what it was fed shows in what it drafts."""

    def __init__(self, requests: list[DraftRequest]) -> None:
        self.requests = requests
        self.calls: list[tuple[int, list[int]]] = []

    def __call__(self, j: int, active: list[int], drafted: torch.Tensor) -> torch.Tensor:
        self.calls.append((j, list(active)))
        rows = [i for i in active if self.requests[i].max_drafts]
        index = torch.tensor(rows, dtype=torch.long)  # [d]
        nxt = (drafted[rows, j - 1] + index + 1) % V if j else index % V  # [d]
        return torch.nn.functional.one_hot(nxt, V).float()  # [d, V]


def test_one_forward_per_position_over_the_rows_still_drafting_each_fed_the_drafts_before():
    requests = [request(0, 3), request(1, 1), request(2, 0), request(3, 2)]
    forward = Recorder(requests)
    proposal = draft_chain(requests, forward, V, (), torch.device("cpu"))
    assert forward.calls == [(0, [0, 1, 2, 3]), (1, [0, 3]), (2, [0])], "a row leaves once it has its drafts"
    assert proposal.tokens == [[0, 1, 2], [1], [], [3, 7]]
    assert proposal.probs is None, "greedy rows are verified by their tokens alone"


def test_no_drafts_asked_is_one_forward_a_catch_up_alone():
    requests = [request(0, 0), request(1, 0)]
    forward = Recorder(requests)
    proposal = draft_chain(requests, forward, V, (), torch.device("cpu"))
    assert forward.calls == [(0, [0, 1])]
    assert proposal.tokens == [[], []]


class Unsure(Recorder):
    """The Recorder's drafts, sure (probability near 1) except at (row, position) pairs in ``unsure`` (0.19)."""

    def __init__(self, requests: list[DraftRequest], unsure: set[tuple[int, int]]) -> None:
        super().__init__(requests)
        self.unsure = unsure

    def __call__(self, j: int, active: list[int], drafted: torch.Tensor) -> torch.Tensor:
        hot = super().__call__(j, active, drafted)  # [d, V]
        rows = [i for i in active if self.requests[i].max_drafts]
        sharp = torch.tensor([0.5 if (i, j) in self.unsure else 10.0 for i in rows])  # [d]
        return hot * sharp[:, None]


def test_a_row_keeps_an_unsure_draft_and_drafts_no_further():
    requests = [request(0, 4), request(1, 4), request(2, 4)]
    forward = Unsure(requests, {(0, 0), (2, 1)})
    proposal = draft_chain(requests, forward, V, (), torch.device("cpu"), confidence=0.3)
    assert proposal.tokens == [[0], [1, 3, 5, 7], [2, 5]], "the same drafts, each row cut after its unsure one"
    assert forward.calls == [(0, [0, 1, 2]), (1, [1, 2]), (2, [1]), (3, [1])], "no forward for a row cut"


def test_without_a_confidence_every_row_drafts_all_it_was_asked():
    requests = [request(0, 4), request(1, 4)]
    forward = Unsure(requests, {(0, 0), (1, 1)})
    proposal = draft_chain(requests, forward, V, (), torch.device("cpu"))
    assert [len(t) for t in proposal.tokens] == [4, 4]


@pytest.mark.parametrize("confidence", [-0.1, 1.0, 2.0])
def test_a_confidence_outside_zero_to_one_is_refused_naming_the_option(confidence):
    with pytest.raises(ValueError, match="draft_confidence"):
        EngineConfig(model="m", draft_confidence=confidence)
