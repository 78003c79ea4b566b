"""Hybrid drafting: prompt lookup where the context matched, the draft model elsewhere, in one step."""

from __future__ import annotations

import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.layers.attention_metadata import SHORT_QUERY
from engine.speculative.step_cost import LinearCost, TargetCost
from engine.types.config import EngineConfig
from engine.types.draft_state import SourceTrack
from engine.types.schedule import ScheduledSeq
from engine.types.sequence import Sequence

REPEATING = [5, 6, 7, 8, 9, 5, 6, 7]  # the 3-gram (5, 6, 7) recurred: the lookup proposes 8, 9, ...
FRESH = [11, 12, 13, 14, 15, 16, 17, 18]  # nothing recurs


def engine_for(ms, k: int | None) -> LLMEngine:
    engine = LLMEngine(EngineConfig(
        model=str(ms.target), draft_model=str(ms.draft), speculative_method="hybrid",
        num_speculative_tokens=k, dtype="float32", device="cpu",
    ))
    if engine.controller is not None:
        # A step of 1 ms + 10 us a token and drafts next to free, whatever this host's timings of the tiny random
        # pair were at start-up (under load, a few timed forwards can be far off): they are not the point here.
        model = engine.controller.cost
        model.target = TargetCost()
        model.target.set_profile([(1, 0.0, 1.01e-3), (9, 0.0, 1.09e-3), (1, 1.0, 1.01e-3)])
        cost = model.drafters["draft_model"] = LinearCost()
        cost.observe(1, 1e-7)
        cost.observe(8, 8e-7)
    return engine


def standalone(rid: str, ids: list[int], params: SamplingParams) -> Sequence:
    """A decoding sequence outside any engine: routing and lookups read only its tokens and params."""
    return Sequence(request_id=rid, token_ids=list(ids), params=params, arrival_time=0.0, num_computed=len(ids) - 1)


def prefilled(engine: LLMEngine, rid: str, ids: list[int], params: SamplingParams) -> Sequence:
    """A sequence the engine has prefilled, with its blocks and draft cache, ready to draft."""
    engine.add_request(rid, ids, params)
    engine.step()
    (seq,) = [s for s in engine.scheduler.running if s.request_id == rid]
    return seq


def planned(engine: LLMEngine, *seqs: Sequence) -> list[ScheduledSeq]:
    """Plan the sequences and schedule each for its wanted drafts (no budget or cache in the way)."""
    engine.drafting.plan(list(seqs))
    return [ScheduledSeq(s, 1, s.draft.k) for s in seqs]


@pytest.mark.parametrize("k", [4, None], ids=["k=4", "adaptive"])
def test_a_matching_context_drafts_by_lookup_and_a_fresh_one_by_the_model(k, model_sets):
    engine = engine_for(model_sets["llama"], k)
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    r, f = standalone("r", REPEATING, greedy), standalone("f", FRESH, greedy)
    if k is None:  # the lookup has been right on r before, the draft model so-so elsewhere: the controller weighs
        # acceptance, not a match alone
        for _ in range(5):
            engine.controller.acceptance["ngram"].observe(r.draft.track("ngram"), 4, 4)
        other = SourceTrack()
        for _ in range(30):
            engine.controller.acceptance["draft_model"].observe(other, 4, 1)
    engine.drafting.plan([r, f])
    assert r.draft.source == "ngram" and f.draft.source == "draft_model"
    assert r.draft.k >= 1 and (k is None or r.draft.k == k), "5 tokens follow the match: k is not cut"
    assert r.draft.lag == 0 and f.draft.lag == len(FRESH) - 1, "the draft model has seen nothing of f yet"


def test_a_one_token_match_is_not_enough_beside_a_draft_model(model_sets):
    engine = engine_for(model_sets["llama"], 4)
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    x = standalone("x", [1, 9, 3, 4, 9], greedy)
    engine.drafting.plan([x])
    assert (x.draft.source, x.draft.k) == ("draft_model", 4)


def test_mixed_proposals_carry_one_hot_q_beside_the_models_q(model_sets):
    engine = engine_for(model_sets["llama"], 3)
    sampled = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    fresh = prefilled(engine, "f", FRESH, sampled)
    rep = standalone("r", REPEATING, sampled)
    drafts = engine.drafting.propose(planned(engine, rep, fresh), engine.vocab_size)
    assert drafts.tokens[0] == [8, 9, 5] and len(drafts.tokens[1]) == 3
    q = drafts.probs  # [2, 3, V]
    assert q is not None
    assert torch.equal(q[0].argmax(-1), torch.tensor([8, 9, 5])) and torch.count_nonzero(q[0]) == 3, "one-hot rows"
    assert torch.allclose(q[1].sum(-1), torch.ones(3)) and torch.count_nonzero(q[1][0]) > 1, "the model's own q"
    assert all(q[1, j, t] > 0 for j, t in enumerate(drafts.tokens[1])), "drafts were drawn from q"


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=1.0, seed=3)], ids=["greedy", "seeded"])
def test_greedy_and_seeded_batches_need_no_distributions(params, model_sets):
    """Both are verified by their tokens alone (seeded ones by the shared-noise choice)."""
    engine = engine_for(model_sets["llama"], 3)
    sp = SamplingParams(max_tokens=8, ignore_eos=True, **params)
    fresh = prefilled(engine, "f", FRESH, sp)
    rep = standalone("r", REPEATING, sp)
    drafts = engine.drafting.propose(planned(engine, rep, fresh), engine.vocab_size)
    assert drafts.probs is None and drafts.tokens[0] == [8, 9, 5] and len(drafts.tokens[1]) == 3


def test_hybrid_is_the_default_with_a_draft_model(model_sets):
    ms = model_sets["llama"]
    llm = LLM(str(ms.target), draft_model=str(ms.draft), dtype="float32", device="cpu")
    assert llm.engine.config.speculative_method.value == "hybrid"
    assert set(llm.engine.controller.acceptance) == {"draft_model", "ngram", "suffix"}, "each source's own acceptance"


def test_a_sequence_that_is_not_decoding_keeps_no_earlier_plan(model_sets):
    """A preempted sequence recomputing its tokens must not carry last step's lookup into this one."""
    engine = engine_for(model_sets["llama"], 4)
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    r = standalone("r", REPEATING, greedy)
    engine.drafting.plan([r])
    assert r.draft.source == "ngram" and r.draft.lookup
    r.reset_for_recompute()
    engine.drafting.plan([r])
    assert (r.draft.source, r.draft.k, r.draft.lookup) == (None, 0, [])


def test_a_drafter_sitting_out_plain_steps_has_faded_once_per_step_when_the_controller_next_reads_it(model_sets):
    """Plain steps skip the pass over the batch and fade the model drafter's estimates later, all at once: by
    the time a plan reads them they must be where one fade per step would have left them."""
    from engine.speculative.drafting import FADE
    from engine.types.draft_state import AcceptanceEstimate

    engine = engine_for(model_sets["llama"], None)
    c = engine.controller
    c.cost.drafters["draft_model"] = dear = LinearCost()
    dear.observe(1, 1.0)  # a second a forward: the draft model never drafts, every step is plain or a probe
    engine.add_request("r", FRESH, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    seq = engine.seqs["r"]
    seq.draft.track("draft_model").alpha = AcceptanceEstimate(hits=8.0, trials=10.0)  # before its first step
    steps, seen = [0], []

    def spied(plan):  # noqa: ANN001, ANN202
        def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            seen.append((steps[0], seq.draft.tracks["draft_model"].alpha.hits))
            return plan(*args, **kwargs)
        return spy

    for name in ("before_lookups", "with_proposals"):
        setattr(c, name, spied(getattr(c, name)))
    for _ in range(30):
        engine.step()
        steps[0] += 1
    assert len({n for n, _ in seen}) >= 3, seen  # planned again several times, after plain steps
    for n, hits in seen:
        assert hits == pytest.approx(8.0 * FADE**n, rel=1e-9), (n, hits)


def test_a_draft_forward_past_a_short_query_is_fitted_apart_from_the_compiled_ones(model_sets):
    """The first draft of a 48-token prompt catches the draft model up on all of it: one eager forward, fitted as a
    catch-up (``cost.catch_ups``), while the one-token forwards after it keep the drafter's own fit."""
    engine = engine_for(model_sets["llama"], None)
    c = engine.controller
    fed: dict[str, list[int]] = {"drafters": [], "catch_ups": []}
    for fits in fed:
        fit = getattr(c.cost, fits)["draft_model"]
        observe = fit.observe
        fit.observe = lambda n, seconds, _observe=observe, _fits=fits: (fed[_fits].append(n), _observe(n, seconds))
    prompt = list(range(11, 11 + 48))  # nothing recurs: the lookups have nothing, the (cheap) draft model drafts
    engine.add_request("p", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert fed["catch_ups"] and min(fed["catch_ups"]) > SHORT_QUERY, fed
    assert fed["drafters"] and max(fed["drafters"]) <= SHORT_QUERY, fed


def test_indexing_a_new_requests_prompt_is_timed_with_the_lookups_but_not_priced_as_asking(model_sets, monkeypatch):
    engine = engine_for(model_sets["llama"], None)
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    for lookup in engine.drafting.lookups:
        index = lookup.index_new

        def slow(seqs: list[Sequence], index=index) -> None:  # a long prompt's first indexing, many times over
            time.sleep(0.05)
            index(seqs)

        monkeypatch.setattr(lookup, "index_new", slow)
    seq = prefilled(engine, "new", REPEATING * 4, greedy)
    assert seq.draft.ngram is None and seq.draft.suffix is None, "nothing indexed before the first ask"
    engine.drafting.plan([seq])
    assert seq.draft.ngram is not None and seq.draft.suffix is not None, "the first plan asked the lookups"
    assert engine.drafting._lookup_seconds >= 0.1, "the step's lookup time holds the indexing"
    assert engine.controller.cost.lookup(1) < 0.01, "the price of asking one sequence does not"
    ngram = seq.draft.ngram
    engine.drafting.lookups[0].index_new([seq])
    assert seq.draft.ngram is ngram and ngram.tokens == seq.token_ids, "indexed once, as its lookup would"


def test_a_structured_sequences_room_for_forced_tokens_stays_within_a_short_query(model_sets):
    """After a lookup's drafts, a structured sequence keeps k_max slots for what its grammar forces; a lookup
    drafting past k_max leaves only what keeps the sequence a short query (past one, its forward is a prompt
    chunk's)."""
    engine = engine_for(model_sets["llama"], None)
    k_max = engine.config.k_max
    seq = standalone("g", REPEATING, SamplingParams(max_tokens=64, temperature=0.0))
    seq.grammar = object()  # any grammar: only whether there is one matters here
    for k, extend in ((4, k_max), (SHORT_QUERY - 4, 3), (SHORT_QUERY - 1, 0)):
        seq.draft.clear_plan()
        engine.drafting._assign(seq, engine.drafting.lookup, k, 0)
        assert (seq.draft.k, seq.draft.extend) == (k + extend, extend), k
        assert seq.draft.k + 1 <= SHORT_QUERY
