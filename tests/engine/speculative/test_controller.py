"""The goodput controller over synthetic step costs: where it switches speculation off, what a catch-up costs
it, and that a plain plan asks no lookup."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.speculative.controller import GoodputController
from engine.speculative.goodput import Plan
from engine.speculative.step_cost import HostCost
from engine.types.draft_state import SourceTrack
from engine.types.sampling_params import SamplingParams
from engine.types.sequence import Sequence


def controller(per_token: float, alpha: float = 0.7, k_max: int = 4, **kw: int) -> GoodputController:
    """A target step of 10 ms + ``per_token`` s per token fed, a draft forward of 1 ms + 50 us per token, host
    work 50 us per sequence; the draft model's drafts held at ``alpha``. ``kw``: GoodputController's."""
    c = GoodputController(k_max, ["draft_model"], ["ngram"], **kw)
    sizes = (1, 2, 3, 5, 9, 17, 33, 65, 129, 257, 513)
    c.cost.target.set_profile([(n, 0.0, 0.010 + per_token * n) for n in sizes])
    for fit, a, b in ((c.cost.drafters["draft_model"], 1e-3, 5e-5), (c.cost.lookup, 0.0, 5e-5)):
        for n in (1, 8):
            fit.observe(n, a + b * n)
    for n in (1, 8):
        c.cost.host.observe({"draft_model": n}, 5e-5 * n)
    hold(c, "draft_model", alpha, k_max)
    return c


def hold(c: GoodputController, source: str, alpha: float, k: int, seed: int = 0) -> None:
    """400 verified steps of ``k`` drafts from ``source``, each held with probability ``alpha``: well known, so no
    exploration bonus to speak of."""
    acc, track, rng = c.acceptance[source], SourceTrack(), random.Random(seed)
    for _ in range(400):
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        acc.observe(track, k, accepted)


def batch(n: int) -> list[Sequence]:
    return [Sequence(str(i), list(range(64)), SamplingParams(max_tokens=64, temperature=0.0), arrival_time=0.0,
                     num_computed=63) for i in range(n)]


def switch_off(c: GoodputController) -> int | None:
    """The smallest batch the controller plans plain for."""
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        seqs = batch(n)
        for s in seqs:
            s.draft.track("ngram").proposes = 0.0  # no lookup ever proposes: the draft model alone
        if not c.before_lookups(seqs, np.ones(n, dtype=bool), {"draft_model": np.zeros(n)}).speculates:
            return n
    return None


def test_speculation_switches_off_where_a_draft_stops_paying_and_that_moves_with_the_step_cost():
    cheap, dear = switch_off(controller(2e-5)), switch_off(controller(2e-4))
    assert cheap is not None and dear is not None
    assert dear < cheap, "a dearer token per step turns speculation off at a smaller batch"
    assert switch_off(controller(2e-4, alpha=0.9)) > dear, "better acceptance keeps it on for longer"


def test_a_long_catch_up_is_priced_into_the_plan():
    c = controller(2e-5)
    seqs = batch(1)
    seqs[0].draft.track("ngram").proposes = 0.0
    on = np.ones(1, dtype=bool)
    assert c.before_lookups(seqs, on, {"draft_model": np.zeros(1)}).speculates
    assert not c.before_lookups(seqs, on, {"draft_model": np.array([20000])}).speculates, (
        "20000 tokens of catch-up (1 s of draft forward: 100 plain steps) outweigh what drafting saves a request "
        "of 64 tokens"
    )


def eager_catch_ups() -> GoodputController:
    """``controller(2e-5)`` whose draft model's eager catch-ups cost 10 ms + 0.1 ms a token: 40 ms for 300 tokens,
    four plain steps."""
    c = controller(2e-5)
    for n in (100, 400):
        c.cost.catch_ups["draft_model"].observe(n, 0.010 + 1e-4 * n)
    return c


def speculates(c: GoodputController, left: int, lag: int = 300) -> bool:
    """Whether one sequence with ``left`` of its max_tokens 64 to go and ``lag`` tokens of catch-up drafts."""
    seqs = batch(1)
    seqs[0].token_ids += [7] * (64 - left)  # output tokens so far
    seqs[0].num_computed = seqs[0].num_tokens - 1
    seqs[0].draft.track("ngram").proposes = 0.0
    return c.before_lookups(seqs, np.ones(1, dtype=bool), {"draft_model": np.array([lag])}).speculates


def test_a_long_catch_up_is_spread_over_what_the_request_has_left_and_a_short_one_is_paid_whole():
    """An eager catch-up past a short query (the prompt, a long stretch sat out) is paid once, and the request
    drafts from a current cache for the rest of its tokens: priced at its share of the drafting steps left, by the
    drafter's eager forwards, it pays with 64 tokens to go and not with 2, nor once requests are seen to end after 4.
    A short catch-up is priced whole at the compiled forwards' rate."""
    c = eager_catch_ups()
    assert speculates(c, 64), "40 ms spread over the drafting steps of 64 tokens"
    assert not speculates(c, 2), "40 ms for the 1 step of 2 tokens left"
    assert speculates(c, 2, lag=30), "30 tokens of compiled catch-up cost 1.5 ms"
    for _ in range(50):
        c.finished(4)
    assert not speculates(c, 64), "requests end after 4 tokens: 64 are not to be expected"


def test_a_long_catch_up_stays_priced_near_whole_where_plans_seldom_give_the_drafter_a_caught_up_sequence():
    """Under load a caught-up sequence may be given the drafter one step in fifty: a catch-up serves that share of
    the steps left, and is worth paying for only as such."""
    c = eager_catch_ups()
    assert speculates(c, 64)
    others = Plan(((None, 0),) * 8, 8.0, 0.01, 0.01)  # eight caught-up sequences, none given the drafter
    for _ in range(60):
        c.observe_use(others, np.ones(8, dtype=bool), {"draft_model": np.zeros(8)})
    assert not speculates(c, 64)


def test_a_lookup_is_priced_at_its_own_host_work_not_at_the_draft_models():
    """64 sequences whose n-gram lookups propose 4 tokens each, held at 0.7: worth it at the lookup's own 10 us of
    host work a sequence, not at the draft model's 3 ms, which a host fit shared by every source charged it."""

    def plan(ngram_seen: bool):  # noqa: ANN202
        c = controller(2e-5)
        c.cost.host = HostCost()
        rng = random.Random(0)
        for _ in range(100):  # steps mixing the two sources, or the draft model's alone
            d, g = rng.randint(0, 64), rng.randint(0, 64) if ngram_seen else 0
            c.cost.host.observe({"draft_model": d, "ngram": g}, 3e-3 * d + 1e-5 * g)
        hold(c, "ngram", 0.7, 4, seed=1)
        seqs, on, lags = batch(64), np.ones(64, dtype=bool), {"draft_model": np.zeros(64)}
        for s in seqs:
            s.draft.proposals["ngram"] = [1, 2, 3, 4]
        return c, c.with_proposals(seqs, on, lags)

    c, seen = plan(ngram_seen=True)
    assert c.cost.host.per_sequence("ngram") == pytest.approx(1e-5, abs=2e-6)
    assert seen.speculates and {src for src, k in seen.choices if k} == {"ngram"}
    c, unseen = plan(ngram_seen=False)
    assert c.cost.host.per_sequence("ngram") == pytest.approx(3e-3, rel=0.01), "never seen: priced like the rest"
    assert not unseen.speculates


def test_a_speculating_plan_is_taken_again_once_with_each_lookup_cut_to_its_proposal_and_newcomers_plain():
    c = controller(2e-5)
    hold(c, "ngram", 0.9, 4, seed=1)
    seqs, on, lags = batch(5), np.ones(5, dtype=bool), {"draft_model": np.zeros(4)}
    for s in seqs:
        s.draft.proposals["ngram"] = [1, 2, 3, 4]
    assert c.again(seqs) is None, "nothing planned yet"
    plan = c.with_proposals(seqs[:4], on[:4], lags)
    c.decide(plan, True)
    assert plan.speculates and {src for src, k in plan.choices if k} == {"ngram"}
    seqs[0].draft.proposals["ngram"], seqs[1].draft.proposals["ngram"] = [], [7, 8]
    joined = [seqs[4], *seqs[1:3]]  # one left, one joined
    again = c.again(joined)
    assert again is not None
    assert again.choices == ((None, 0), ("ngram", min(2, plan.choices[1][1])), plan.choices[2])
    c.decide(again, True)
    assert c.again(joined) is None, "taken again once: the next step plans"
    c.decide(c.with_proposals(seqs[:4], on[:4], lags), True)
    assert c.again([seqs[0], seqs[4]]) is None, "nothing of the plan left to draft: planned"
    c.decide(c.with_proposals(seqs[:4], on[:4], lags), True)
    c.margin = float("inf")
    assert c.again(seqs[:4]) is None, "a plan that no longer clears the margin is made again"


@pytest.mark.parametrize(("proposes", "asked"), [(0.3, True), (0.02, False)])
def test_a_lookup_is_asked_where_its_expected_drafts_pay(proposes, asked):
    """A target step of 5 ms + 5 ms a token fed, asking the lookup 1 ms, and an n-gram lookup whose drafts hold
    at 0.9, proposing on a share of its asks: a draft is paid for only where one is proposed, so at 0.3 asking
    pays (4 drafts: 1.93 expected tokens for 1.7 plain steps); priced as if it always drafted (3.1 plain steps)
    it did not, and the sequence stayed plain and unasked. At 0.02 the asking is not worth it."""
    c = GoodputController(4, [], ["ngram"])
    c.cost.target.set_profile([(n, 0.0, 0.005 + 5e-3 * n) for n in (1, 2, 3, 5, 9)])
    for n in (1, 2):
        c.cost.lookup.observe(n, 1e-3 * n)
    hold(c, "ngram", 0.9, 4)
    seqs = batch(1)
    seqs[0].draft.track("ngram").proposes = proposes
    plan = c.before_lookups(seqs, np.ones(1, dtype=bool), {})
    assert plan.speculates == asked and c.wants_lookups(plan) == asked


def test_a_plain_plan_asks_no_lookup_until_a_probe_is_due():
    c = controller(1e-2)  # every token is dear: nothing pays
    c.probe_interval = 4
    seqs = batch(8)
    plans = [c.before_lookups(seqs, np.ones(8, dtype=bool), {"draft_model": np.zeros(8)}) for _ in range(8)]
    assert not any(p.speculates for p in plans)
    assert [c.wants_lookups(p) for p in plans] == [False, False, False, True] * 2


def plain_steps(c: GoodputController, seqs: list, planning: float = 0.0):  # noqa: ANN201
    """A step function over ``c``: "kept" where the plain decision stands, else it plans (``planning`` seconds
    of host time, as Drafting measures it) and says "planned" or "probed"."""
    on, lags = np.ones(len(seqs), dtype=bool), np.zeros(len(seqs))

    def step(n: int = len(seqs), fresh: bool = False) -> str:
        if c.still_plain(n, fresh):
            return "kept"
        plan = c.before_lookups(seqs[:n], on[:n], {"draft_model": lags[:n]})
        probed = c.wants_lookups(plan)
        c.decide(plan, probed)
        if not probed:
            c.observe_planning(n, planning)
        return "probed" if probed else "planned"

    return step


def test_a_plain_decision_stands_a_few_steps_without_planning_again():
    c = controller(1e-2)  # nothing pays
    c.probe_interval = 10_000  # no probe in the way
    step = plain_steps(c, batch(16))
    assert [step(8) for _ in range(9)] == ["planned"] + ["kept"] * 7 + ["planned"], "a plan every 8 steps"
    assert step(7) == "kept", "a request left: the decision stands"
    assert step(8, fresh=True) == "planned", "a request never planned for joined: planned again"
    c.decide(plan_that_speculates(c), False)
    assert step(11) == "planned", "a speculating decision is never kept"


def test_plain_decisions_are_planned_again_less_often_where_planning_costs_more_than_its_budget():
    c = controller(1e-2)  # nothing pays
    c.probe_interval = 10_000  # no probe in the way
    plain = c.before_lookups(batch(8), np.ones(8, dtype=bool), {"draft_model": np.zeros(8)}).plain_seconds
    step = plain_steps(c, batch(8), planning=0.2 * plain)  # a fifth of a plain step: 20 steps pay for one
    steps = [step() for _ in range(100)]
    gaps = np.diff([i for i, s in enumerate(steps) if s != "kept"])
    assert len(gaps) >= 3 and all(g == 20 for g in gaps[1:]), gaps
    cheap = controller(1e-2)
    cheap.probe_interval = 10_000
    step = plain_steps(cheap, batch(8), planning=1e-3 * plain)
    steps = [step() for _ in range(40)]
    assert set(np.diff([i for i, s in enumerate(steps) if s != "kept"])) == {8}, "cheap planning: every 8 steps"


def plan_that_speculates(c: GoodputController):  # noqa: ANN201
    from engine.speculative.goodput import Plan

    return Plan((("draft_model", 2),) * 8, 10.0, 1.0, 1.0)


def test_the_plan_beats_the_plain_step_by_the_margin_or_is_plain():
    c = controller(2e-5)
    seqs = batch(4)
    on, lags = np.ones(4, dtype=bool), {"draft_model": np.zeros(4)}
    plan = c.before_lookups(seqs, on, lags)
    assert plan.speculates and plan.speedup > 1.02
    c.margin = plan.speedup  # now the same plan is not good enough
    assert not c.before_lookups(seqs, on, lags).speculates


@pytest.mark.parametrize("n", [1, 8, 64])
def test_every_planned_sequence_gets_at_most_k_max_drafts_from_a_source_it_has(n):
    c = controller(2e-5)
    seqs = batch(n)
    plan = c.before_lookups(seqs, np.ones(n, dtype=bool), {"draft_model": np.zeros(n)})
    assert len(plan.choices) == n
    assert all((src is None and k == 0) or (src in ("draft_model", "ngram") and 1 <= k <= 4) for src, k in plan.choices)


def test_the_host_work_of_plain_and_speculative_steps_is_measured_apart(model_sets):
    from engine import LLM, SamplingParams
    from tests.engine.lossless import flip_plain_and_speculative

    ms = model_sets["llama"]
    llm = LLM(model=str(ms.target), draft_model=str(ms.draft), dtype="float32", device="cpu")
    modes = flip_plain_and_speculative(llm.engine)  # a fresh cost model every step: read it after the last one
    seen: dict[str, list[str]] = {"plain": [], "speculate": []}
    observe_step = llm.engine.drafting.observe_step

    def spy(step_seconds):  # noqa: ANN001, ANN202
        cost = llm.engine.controller.cost
        before = cost.host._w, cost.host_plain._w
        observe_step(step_seconds)
        moved = "host" if cost.host._w != before[0] else "host_plain" if cost.host_plain._w != before[1] else "-"
        mode = llm.engine.drafting.decision.mode
        if mode:
            seen["speculate" if mode == "speculate" else "plain"].append(moved)

    llm.engine.drafting.observe_step = spy
    llm.generate([[5, 6, 7, 8, 9, 5, 6, 7], [11, 12, 13]], SamplingParams(max_tokens=16, temperature=0.0))
    assert modes.get("speculate", 0) and modes.get("plain", 0) + modes.get("probe", 0)
    assert seen["plain"] and set(seen["plain"]) == {"host_plain"}, seen
    assert seen["speculate"] and set(seen["speculate"]) <= {"host", "host_plain"} and "host" in seen["speculate"], seen


def test_probes_thin_out_where_asking_the_whole_batch_costs_more_than_their_budget():
    c = controller(1e-2)  # nothing pays
    c.probe_interval, c.probe_budget = 4, 0.01
    seqs, on, lags = batch(8), np.ones(8, dtype=bool), {"draft_model": np.zeros(8)}

    def probes(steps: int) -> list[int]:
        out = []
        for i in range(steps):
            if c.wants_lookups(c.before_lookups(seqs, on, lags)):
                out.append(i)
        return out

    assert probes(16) == [3, 7, 11, 15], "cheap asks: a probe every probe_interval steps"
    plain = c.before_lookups(seqs, on, lags).plain_seconds
    c.cost.lookup = type(c.cost.lookup)()
    for n in (1, 8):  # asking 8 sequences now costs 40% of a plain step: 40 plain steps pay for one probe
        c.cost.lookup.observe(n, 0.05 * plain * n)
    c._since_asked = 0
    gaps = np.diff(probes(200))
    assert len(gaps) and all(g == 40 for g in gaps), gaps


def test_by_default_probes_come_as_often_as_their_budget_allows():
    """No floor of steps between probes: where one sequence's asks cost 4.5% of a plain step, a budget of 1% of
    the plain steps between probes asks them every 4 steps (a floor of 16 once left a batch of one plain for 16
    steps after each miss)."""
    c = controller(1e-2)
    c.margin = float("inf")  # no plan is good enough: every step is plain
    seqs, on, lags = batch(1), np.ones(1, dtype=bool), {"draft_model": np.zeros(1)}
    plain = c.before_lookups(seqs, on, lags).plain_seconds
    c.cost.lookup = type(c.cost.lookup)()
    for n in (1, 8):
        c.cost.lookup.observe(n, 0.045 * plain * n)
    assert c.probe_budget == 0.01
    probes = [i for i in range(16) if c.wants_lookups(c.before_lookups(seqs, on, lags))]
    assert probes == [3, 7, 11, 15]


def test_after_a_speculating_step_the_lookups_are_asked_without_a_plan_from_expectations():
    """A step after one that speculated asks the lookups straight away (one solve of the batch, on the real
    proposals); after a plain or probing step it plans from expectations first, so a plain step asks nothing."""
    c = controller(1e-6)  # every draft is cheap: the draft model's plan speculates
    seqs = batch(8)
    on, lags = np.ones(8, dtype=bool), {"draft_model": np.zeros(8)}
    assert not c.asks_again()  # nothing decided yet
    c.decide(c.before_lookups(seqs, on, lags), probed=False)
    assert c.decision.mode == "speculate" and c.asks_again()
    dear = controller(1e-2)
    dear.decide(dear.before_lookups(seqs, on, lags), probed=True)
    assert dear.decision.mode == "probe" and not dear.asks_again()
    no_lookups = GoodputController(4, ["draft_model"], [])
    no_lookups.decision = c.decision
    assert not no_lookups.asks_again()  # nothing to ask: the first plan is the plan


def test_a_batch_of_one_gets_the_best_source_and_k_on_its_own_cost_model():
    """One sequence: every (source, k) priced whole on the controller's own terms (the target's profile itself,
    not a line through it), and the plan is the best of them or the plain step."""
    c = controller(2e-5)
    # A profile no line fits: a dip at 5 tokens (other matmul kernels), dearer 2 and 3.
    sizes, costs = (1, 2, 3, 5, 9, 17), (0.010, 0.0135, 0.0138, 0.0122, 0.0150, 0.020)
    c.cost.target.set_profile([(n, 0.0, t) for n, t in zip(sizes, costs)])
    hold(c, "ngram", 0.8, 4, seed=1)
    seq = batch(1)
    on, lags = np.ones(1, dtype=bool), {"draft_model": np.zeros(1)}
    for proposed in ([], [5], [5, 6, 7, 8]):
        seq[0].draft.proposals = {"ngram": proposed}
        plan = c.with_proposals(seq, on, lags)
        n_ctx = seq[0].num_tokens / 1000.0
        t0 = c.cost.target(1.0, n_ctx)
        host_a, _ = c.cost.host.coefficients()
        best, want = 1.0 / t0, (None, 0)
        for name, cap in (("draft_model", 4), ("ngram", len(proposed))):
            gains = c.acceptance[name].gains([seq[0].draft.track(name)])[0]
            a, b = c.cost.drafters["draft_model"].coefficients() if name == "draft_model" else (0.0, 0.0)
            for k in range(1, cap + 1):
                seconds = (c.cost.target(1.0 + k, n_ctx, True) + host_a + c.cost.host.per_sequence(name)
                           + k * (float(c.cost.target.per_token(np.array([64.0]))[0]) + b) + a * k)
                if (1.0 + gains[:k].sum()) / seconds > best:
                    best, want = (1.0 + gains[:k].sum()) / seconds, (name, k)
        if best * t0 <= 1.0 + c.margin:
            want = (None, 0)
        assert plan.choices == (want,), proposed
    assert plan.choices[0][0] == "ngram", "four lookup drafts at 0.8 beat the draft model's forwards"


def test_a_lookup_drafts_past_k_max_within_the_steps_rows_and_the_draft_model_never_does():
    """lookup_k_max 12 beside k_max 4, and 40 rows a step: one sequence copying its prompt gets all 12 of its
    lookup's drafts held at 0.95; without a proposal the draft model drafts at most 4; a batch shares the 8 drafts
    past k_max, and eight sequences the rows, so each lookup gets at most 4 there (never fewer than k_max)."""
    c = controller(2e-5, alpha=0.95, lookup_k_max=12, rows=40)
    assert [c.lookup_cap(n) for n in (1, 2, 4, 8, 64)] == [12, 8, 6, 4, 4]
    assert GoodputController(4, [], ["ngram"], lookup_k_max=12).lookup_cap(3) == 6, "no rows: no bound of theirs"
    assert c.acceptance["ngram"].k_max == 12 and c.acceptance["draft_model"].k_max == 4
    hold(c, "ngram", 0.95, 12, seed=1)
    lags = {"draft_model": np.zeros(1)}
    one = batch(1)
    one[0].draft.proposals = {"ngram": list(range(100, 120))}
    assert c.with_proposals(one, np.ones(1, dtype=bool), lags).choices == (("ngram", 12),)
    one[0].draft.proposals = {"ngram": []}
    src, k = c.with_proposals(one, np.ones(1, dtype=bool), lags).choices[0]
    assert src == "draft_model" and 1 <= k <= 4
    eight = batch(8)
    for s in eight:
        s.draft.proposals = {"ngram": list(range(100, 120))}
    plan = c.with_proposals(eight, np.ones(8, dtype=bool), {"draft_model": np.zeros(8)})
    assert plan.speculates and all(k <= 4 for _, k in plan.choices)
    assert sum(1 + k for _, k in plan.choices) <= 40
