"""The hybrid drafter: prompt lookup where the context matched, the draft model elsewhere, in one step."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sequence import Sequence
from engine.spec.drafter import DraftRequest
from engine.spec.hybrid import HybridDrafter
from engine.spec.planner import LOOKUP, MODEL

REPEATING = [5, 6, 7, 8, 9, 5, 6, 7]  # the 3-gram (5, 6, 7) recurred: the lookup proposes 8, 9, ...
FRESH = [11, 12, 13, 14, 15, 16, 17, 18]  # nothing recurs


def engine_for(ms, k: int | None) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(ms.target), draft_model=str(ms.draft), speculative_method="hybrid",
        num_speculative_tokens=k, dtype="float32", device="cpu",
    ))


def standalone(rid: str, ids: list[int], params: SamplingParams) -> Sequence:
    """A sequence outside any engine: routing and lookups read only its tokens and params."""
    return Sequence(request_id=rid, token_ids=list(ids), params=params, arrival_time=0.0)


def prefilled(engine: LLMEngine, rid: str, ids: list[int], params: SamplingParams) -> Sequence:
    """A sequence the engine has prefilled, with its blocks and draft cache, ready to draft."""
    engine.add_request(rid, ids, params)
    engine.step()
    (seq,) = [s for s in engine.scheduler.running if s.request_id == rid]
    return seq


@pytest.mark.parametrize("k", [4, None], ids=["k=4", "adaptive"])
def test_a_matching_context_drafts_by_lookup_and_a_fresh_one_by_the_model(k, model_sets):
    engine = engine_for(model_sets["llama"], k)
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    route = {rid: engine.planner.plan_one(standalone(rid, ids, greedy), batch=2) for rid, ids in (("r", REPEATING),
                                                                                        ("f", FRESH))}
    assert route["r"][0] == LOOKUP and route["f"][0] == MODEL
    assert route["r"][1] >= 1 and (k is None or route["r"][1] == k), "5 tokens follow the match: k is not cut"


def test_a_one_token_match_is_not_enough_beside_a_draft_model(model_sets):
    engine = engine_for(model_sets["llama"], 4)
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    assert engine.planner.plan_one(standalone("x", [1, 9, 3, 4, 9], greedy), batch=1) == (MODEL, 4)


def test_mixed_proposals_carry_one_hot_q_beside_the_models_q(model_sets):
    engine = engine_for(model_sets["llama"], 3)
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    fresh = prefilled(engine, "f", FRESH, sampled)
    rep = standalone("r", REPEATING, sampled)
    drafter = engine.drafter
    assert isinstance(drafter, HybridDrafter)
    match = drafter.match(rep, 3)
    assert match == [8, 9, 5]
    proposal = drafter.propose([DraftRequest(rep, 3, lookup=True), DraftRequest(fresh, 3)])
    assert proposal.tokens[0] == match and len(proposal.tokens[1]) == 3
    q = proposal.probs  # [2, 3, V]
    assert q is not None
    assert torch.equal(q[0].argmax(-1), torch.tensor(match)) and torch.count_nonzero(q[0]) == 3, "one-hot rows"
    assert torch.allclose(q[1].sum(-1), torch.ones(3)) and torch.count_nonzero(q[1][0]) > 1, "the model's own q"
    assert all(q[1, j, t] > 0 for j, t in enumerate(proposal.tokens[1])), "drafts were drawn from q"


def test_greedy_mixed_batch_needs_no_distributions(model_sets):
    engine = engine_for(model_sets["llama"], 3)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    fresh = prefilled(engine, "f", FRESH, greedy)
    rep = standalone("r", REPEATING, greedy)
    engine.drafter.match(rep, 3)
    proposal = engine.drafter.propose([DraftRequest(rep, 3, lookup=True), DraftRequest(fresh, 3)])
    assert proposal.probs is None and proposal.tokens[0] == [8, 9, 5] and len(proposal.tokens[1]) == 3


def test_hybrid_is_the_default_with_a_draft_model(model_sets):
    ms = model_sets["llama"]
    llm = LLM(str(ms.target), draft_model=str(ms.draft), dtype="float32", device="cpu")
    assert llm.engine.config.speculative_method.value == "hybrid"
    assert set(llm.engine.planner.policies) == {MODEL, LOOKUP}, "one adaptive policy per source"
