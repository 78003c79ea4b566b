"""The start-up profile of the step-cost model under a neighbour's bursts of work: a fake runner on a fake clock,
so what is timed is exactly what the test says."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine.speculative import calibrate as calibration
from engine.speculative.controller import GoodputController
from engine.worker.forward_batch import ForwardBatch

K_MAX = 8


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class FakeRunner:
    """A forward costs 10 ms + 0.1 ms a token, plus whatever ``burst(call, tokens)`` adds."""

    def __init__(self, clock: Clock, burst: Callable[[int, int], float]) -> None:
        self.clock, self.burst, self.calls = clock, burst, 0

    @staticmethod
    def cost(tokens: int) -> float:
        return 0.010 + 1e-4 * tokens

    def forward(self, batch: ForwardBatch) -> None:
        tokens = sum(len(t) for t in batch.token_ids)
        self.clock.now += self.cost(tokens) + self.burst(self.calls, tokens)
        self.calls += 1

    def synchronize(self) -> None:
        pass


def profile(monkeypatch: pytest.MonkeyPatch, burst: Callable[[int, int], float]) -> GoodputController:
    clock = Clock()
    monkeypatch.setattr(calibration, "time", clock)
    controller = GoodputController(K_MAX, [], ["ngram"])
    calibration.calibrate(controller, FakeRunner(clock, burst), {}, block_size=16, max_tokens=2048,
                          num_blocks=4096, max_seqs=64)
    return controller


@pytest.mark.parametrize("start", [0, 3, 7, 12])
def test_a_neighbours_burst_costs_one_pass_not_one_size(monkeypatch, start):
    """Six forwards in a row, each 200 ms late (another server compiling), wherever in the profile they fall:
    repeats in a row would have priced one size at the burst."""
    target = profile(monkeypatch, lambda call, tokens: 0.2 if start <= call < start + 6 else 0.0).cost.target
    for tokens in (1, 2, 9, 72, 576):
        assert target(tokens, 0.0, tokens > 1) == pytest.approx(FakeRunner.cost(tokens), rel=0.02), tokens


def test_a_size_that_costs_several_times_a_larger_one_is_timed_again(monkeypatch):
    """One sequence's 9-token verify slow in every pass of the first round (a burst that happened to line up
    with it): more than 1.5x the 18 tokens of two sequences, so it is re-timed, and priced as it then ran."""
    seen = {"calls": 0}

    def burst(call: int, tokens: int) -> float:
        if tokens == K_MAX + 1:
            seen["calls"] += 1
            return 0.2 if seen["calls"] <= calibration.PASSES else 0.0
        return 0.0

    target = profile(monkeypatch, burst).cost.target
    assert seen["calls"] > calibration.PASSES, "re-timed"
    assert target(K_MAX + 1, 0.0, True) == pytest.approx(FakeRunner.cost(K_MAX + 1), rel=0.02)


def test_a_size_that_really_costs_more_keeps_its_price(monkeypatch):
    """On a CPU 2 or 3 tokens can cost more than 5 (other kernels): measured again, and kept as measured."""
    target = profile(monkeypatch, lambda call, tokens: 0.05 if tokens == 2 else 0.0).cost.target
    assert target(2, 0.0, True) == pytest.approx(FakeRunner.cost(2) + 0.05, rel=0.02)


def test_a_later_profile_writes_only_into_the_blocks_it_is_given_and_starts_the_host_terms_again(monkeypatch):
    """Once the compiled forwards serve, the profile is taken again in the background compile's own blocks
    (sequences own the rest): every table stays inside them, the target and drafter terms are the new forwards',
    and the host terms (and a drafter's catch-ups) start again from the prior: what the eager steps taught a
    speculating step to cost is only corrected by speculating, and priced too high it never is."""
    clock = Clock()
    monkeypatch.setattr(calibration, "time", clock)
    controller = GoodputController(K_MAX, ["draft_model"], ["ngram"])
    slow, fast = FakeRunner(clock, lambda call, tokens: 0.0), FakeRunner(clock, lambda call, tokens: 0.0)
    calibration.calibrate(controller, slow, {"draft_model": slow}, block_size=16, max_tokens=2048, num_blocks=4096,
                          max_seqs=64)
    prior = controller.cost.parameters()
    for _ in range(50):  # what the eager steps taught: far dearer than the prior
        controller.cost.host.observe({"draft_model": 1}, 5e-3)
        controller.cost.host_plain.observe(1, 2e-3)
        controller.cost.lookup.observe(4, 4e-3)
        controller.cost.catch_ups["draft_model"].observe(128, 2e-2)
        controller.cost.catch_ups["draft_model"].observe(64, 1.5e-2)
    taught = controller.cost.parameters()
    assert taught["host_per_step"] + taught["host_per_sequence_draft_model"] > 4e-3
    assert taught["lookup_per_step"] + 4 * taught["lookup_per_sequence"] > 3e-3

    tables: list[int] = []
    fast.cost = lambda tokens: 0.001 + 1e-5 * tokens  # type: ignore[method-assign]
    forward = fast.forward

    def recording(batch: ForwardBatch) -> None:
        tables.extend(b for table in batch.block_tables for b in table)
        forward(batch)

    fast.forward = recording  # type: ignore[method-assign]
    first, end = 4000, 4000 + calibration.profile_blocks(K_MAX, 16, 2048, 64)
    calibration.calibrate(controller, fast, {"draft_model": fast}, block_size=16, max_tokens=2048, num_blocks=end,
                          max_seqs=64, first_block=first)
    assert tables and min(tables) >= first and max(tables) < end
    params = controller.cost.parameters()
    assert params["target_decode_1_tokens"] == pytest.approx(fast.cost(1), rel=0.02)
    assert params["target_verify_576_tokens"] == pytest.approx(fast.cost(576), rel=0.02), "the largest verify fits"
    assert params["draft_model_per_forward"] == pytest.approx(0.001, rel=0.05), "the old forwards' fit is gone"
    assert not controller.cost.catch_ups["draft_model"].ready, "the eager catch-ups are timed again"
    for term in ("host_per_step", "host_per_sequence", "lookup_per_step", "lookup_per_sequence"):
        assert params[term] == pytest.approx(prior[term]), term
    assert "host_per_sequence_draft_model" not in params, "no source's own fit survives"
    assert controller.cost.host_plain(1) == pytest.approx(calibration.HOST_PRIOR_SECONDS)
