"""Greedy speculative output equals transformers' greedy generate on the target alone, for every
architecture, drafter, batch size and draft length."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.device import GREEDY_ENGINE
from tests.engine.lossless import (
    MAX_NEW,
    Reference,
    alternate_drafters,
    assert_same_as_target,
    cut_at_the_median,
    flip_plain_and_speculative,
    prompts_for,
)
from tests.tiny_models import ARCHS

GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
WARM_BLOCK = 4  # small enough that the 5- to 10-token prompts fill blocks the prefix cache can share


@pytest.fixture(scope="module")
def references(model_sets) -> dict[str, Reference]:
    return {arch: Reference(ms.target) for arch, ms in model_sets.items()}


def run_batches(llm: LLM, ref: Reference, prompts: list[list[int]], label: str) -> None:
    """Batch 1 (two prompts, one at a time), batch 3 and batch 8 through the same engine. With blocks
    of 4 tokens the later batches find the earlier prompts' blocks in the prefix cache: the matrix
    runs with the cache warm."""
    engine, hits, step = llm.engine, [0], llm.engine.step

    def counted_step():  # noqa: ANN202
        outputs = step()
        hits[0] += engine.last_step.prefix_cache_hits if engine.last_step else 0
        return outputs

    engine.step = counted_step
    for batch in ([prompts[0]], [prompts[5]], prompts[1:4], prompts):
        outs = llm.generate(batch, GREEDY)
        for prompt, out in zip(batch, outs):
            assert_same_as_target(ref, prompt, out.token_ids, f"{label} batch={len(batch)}")
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks, f"{label}: blocks leaked after the batch finished"
    if engine.block_manager.block_size == WARM_BLOCK:
        assert hits[0] > 0, f"{label}: nothing came from the prefix cache"


# "self": the target's first layer drafts (the tiny targets have two); "hybrid+self": lookup, draft model and
# the target's first layer, each sequence routed to one of them per step.
METHODS = {
    "draft_model": dict(draft=True),
    "ngram": dict(),
    "suffix": dict(),
    "hybrid": dict(draft=True),
    "self": dict(draft_layers=1),
    "hybrid+self": dict(draft=True, draft_layers=1),
    "self+exit": dict(exit=True),  # the first layer drafting through a trained exit head (a reduced vocabulary)
    "eagle": dict(eagle=True),
    "hybrid+eagle": dict(eagle=True),  # an EAGLE-3 head beside prompt lookup
}


# The combinations and suffix decoding at k = 4 and adaptive only, for the suite's time: the "self" and "eagle" cases
# cover the early exit and the head at every k, "ngram" a one-hot lookup's.
CASES = [(m, k) for m in METHODS for k in (1, 4, 8, None) if ("+" not in m and m != "suffix") or k in (4, None)]


@pytest.mark.parametrize(("method", "k"), CASES, ids=lambda v: v if isinstance(v, str) else
                         f"k={v if v is not None else 'adaptive'}")
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_speculation_equals_target_alone(arch, method, k, model_sets, eagle_heads, exit_targets, references,
                                                tokenizer_dir):
    ms = model_sets[arch]
    sources = METHODS[method]
    llm = LLM(
        model=str(exit_targets[arch] if sources.get("exit") else ms.target),
        draft_model=str(eagle_heads[arch]) if sources.get("eagle") else str(ms.draft) if sources.get("draft") else None,
        draft_layers=sources.get("draft_layers"),
        speculative_method=method.split("+")[0],
        num_speculative_tokens=k,
        **GREEDY_ENGINE,
        block_size=WARM_BLOCK,
    )
    mixes = alternate_drafters(llm) if method == "hybrid+self" else None
    run_batches(llm, references[arch], prompts_for(tokenizer_dir), f"{arch}/{method}/k={k}")
    if k is not None:
        assert llm.stats().num_draft_tokens > 0, "speculation never ran, so this test proved nothing"
    if mixes is not None:
        assert frozenset({"draft_model", "self"}) in mixes, "no step verified both drafters' proposals at once"


@pytest.mark.parametrize("method", ["draft_model", "hybrid", "suffix", "self", "eagle"])
def test_greedy_across_the_plain_fast_path_and_back_equals_target_alone(method, model_sets, eagle_heads, references,
                                                                       tokenizer_dir):
    """The goodput controller turns speculation off (the plain step: no draft forward, no drafts) and on again
    every other step: the drafters catch up on what they missed, and the output stays the target's."""
    ms = model_sets["llama"]
    sources = METHODS[method]
    draft = eagle_heads["llama"] if sources.get("eagle") else ms.draft if sources.get("draft") else None
    llm = LLM(model=str(ms.target), draft_model=str(draft) if draft else None, draft_layers=sources.get("draft_layers"),
              speculative_method=method, **GREEDY_ENGINE, block_size=WARM_BLOCK)
    modes = flip_plain_and_speculative(llm.engine)
    run_batches(llm, references["llama"], prompts_for(tokenizer_dir), f"llama/{method}/flipping")
    assert modes.get("plain", 0) + modes.get("probe", 0) > 0 and modes.get("speculate", 0) > 0, modes
    assert llm.stats().num_draft_tokens > 0, "speculation never ran, so this test proved nothing"


@pytest.mark.parametrize("method", ["ngram", "suffix", "hybrid"])
def test_greedy_with_lookups_drafting_past_k_max_equals_target_alone(method, model_sets, references, tokenizer_dir):
    """Under adaptive k a lookup may give a sequence up to max_lookup_tokens drafts, past max_speculative_tokens,
    which still bounds the draft model's: long one-hot drafts verify exactly, beside the model's in one step."""
    ms = model_sets["llama"]
    llm = LLM(model=str(ms.target), draft_model=str(ms.draft) if method == "hybrid" else None,
              speculative_method=method, max_speculative_tokens=2, max_lookup_tokens=12, **GREEDY_ENGINE,
              block_size=WARM_BLOCK)
    flip_plain_and_speculative(llm.engine)  # drafts free every other step: the longest proposal is planned
    drafting, propose, longest = llm.engine.drafting, llm.engine.drafting.propose, {}

    def measured(scheduled, vocab):  # noqa: ANN001, ANN202
        drafts = propose(scheduled, vocab)
        for s, tokens in zip(scheduled, drafts.tokens):
            name = s.seq.draft.source
            longest[name] = max(longest.get(name, 0), len(tokens))
        return drafts

    drafting.propose = measured
    run_batches(llm, references["llama"], prompts_for(tokenizer_dir), f"llama/{method}/past k_max")
    lookups = [n for n in ("ngram", "suffix") if n in longest]
    assert lookups and max(longest[n] for n in lookups) > 2, longest
    assert longest.get("draft_model", 0) <= 2, longest


@pytest.mark.parametrize("method", ["draft_model", "self", "eagle"])
def test_greedy_with_rows_cut_after_an_unsure_draft_equals_target_alone(method, model_sets, eagle_heads, references,
                                                                        tokenizer_dir, monkeypatch):
    """--draft-confidence: a row stops drafting after a draft its drafter was unsure of, in steps where others
    draft all four."""
    ms = model_sets["llama"]
    sources = METHODS[method]
    draft = eagle_heads["llama"] if sources.get("eagle") else ms.draft if sources.get("draft") else None
    llm = LLM(model=str(ms.target), draft_model=str(draft) if draft else None, draft_layers=sources.get("draft_layers"),
              speculative_method=method, num_speculative_tokens=4, draft_confidence=1e-9, **GREEDY_ENGINE,
              block_size=WARM_BLOCK)
    prompts = prompts_for(tokenizer_dir)
    cut_at_the_median(llm, lambda: llm.generate(prompts[4:6], GREEDY), monkeypatch)
    stats = llm.stats()  # the engine's running totals
    before = stats.num_drafts, stats.num_draft_tokens
    run_batches(llm, references["llama"], prompts, f"llama/{method}/cut")
    per_step = (stats.num_draft_tokens - before[1]) / (stats.num_drafts - before[0])
    assert 1.0 < per_step < 3.5, f"{per_step:.2f} drafts a sequence-step: the cut never or always happened"


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_without_speculation_equals_target_alone(arch, model_sets, references, tokenizer_dir):
    ms = model_sets[arch]
    llm = LLM(model=str(ms.target), speculative_method="none", **GREEDY_ENGINE, block_size=WARM_BLOCK)
    run_batches(llm, references[arch], prompts_for(tokenizer_dir), f"{arch}/none")


def test_unrelated_draft_with_adaptive_k_stays_lossless(model_sets, references, tokenizer_dir):
    ms = model_sets["llama"]
    llm = LLM(model=str(ms.target), draft_model=str(ms.unrelated), **GREEDY_ENGINE)
    run_batches(llm, references["llama"], prompts_for(tokenizer_dir), "llama/unrelated")


@pytest.mark.parametrize("method", ["draft_model", "self"])
def test_preemption_under_a_tiny_kv_cache_stays_lossless(method, model_sets, references, tokenizer_dir):
    """19 blocks of 4 tokens hold about one and a half sequences: eight at once must preempt."""
    ms = model_sets["llama"]
    llm = LLM(
        model=str(ms.target),
        draft_model=str(ms.draft) if method == "draft_model" else None,
        draft_layers=1 if method == "self" else None,
        speculative_method=method,
        num_speculative_tokens=4,
        **GREEDY_ENGINE,
        max_model_len=64,
        block_size=4,
        num_kv_blocks=19,
    )
    prompts = prompts_for(tokenizer_dir)
    preempted = 0
    outs = {}
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
        outs[str(i)] = []
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].extend(out.new_token_ids)
        preempted += engine.last_step.num_preempted if engine.last_step else 0
    assert preempted > 0, "the cache was large enough that nothing was preempted"
    for i, p in enumerate(prompts):
        assert_same_as_target(references["llama"], p, outs[str(i)], f"preempted request {i}")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("method", ["draft_model", "self"])
def test_chunked_prefill_with_a_small_token_budget_stays_lossless(method, model_sets, references, tokenizer_dir):
    ms = model_sets["qwen2"]
    llm = LLM(
        model=str(ms.target), draft_model=str(ms.draft) if method == "draft_model" else None,
        draft_layers=1 if method == "self" else None, speculative_method=method, num_speculative_tokens=3,
        **GREEDY_ENGINE, max_num_batched_tokens=5,
    )
    run_batches(llm, references["qwen2"], prompts_for(tokenizer_dir), "qwen2/chunked")
