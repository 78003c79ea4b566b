"""A seeded request's output is a function of its seed alone: not of its neighbours, the token budget,
the free KV slots, preemption, the draft length, or whether speculation is on at all."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.engine.lossless import Reference, assert_same_sample_unless_near_tie, prompts_for

SEED, TEMPERATURE, TOP_P = 42, 1.0, 0.95
SEEDED = SamplingParams(max_tokens=40, temperature=TEMPERATURE, top_p=TOP_P, seed=SEED, ignore_eos=True)


def llm_for(ms, method: str, k: int | None, **kw) -> LLM:
    return LLM(
        model=str(ms.target), draft_model=str(ms.draft) if method in ("draft_model", "hybrid") else None,
        speculative_method=method, num_speculative_tokens=k, dtype="float32", device="cpu", **kw,
    )


@pytest.fixture(scope="module")
def alone_without_speculation(model_sets, tokenizer_dir) -> list[int]:
    llm = llm_for(model_sets["llama"], "none", None)
    return llm.generate([prompts_for(tokenizer_dir)[0]], SEEDED)[0].token_ids


def crowded(llm: LLM, tokenizer_dir) -> tuple[list[int], int]:
    """The seeded request behind four older ones: (its tokens, preemptions in the run)."""
    prompts = prompts_for(tokenizer_dir)
    older = [SamplingParams(max_tokens=n, temperature=0.8, ignore_eos=True) for n in (90, 80, 100, 85)]
    sched, preempted = llm.engine.scheduler, [0]
    preempt = sched._preempt

    def counting(seq):  # noqa: ANN001, ANN202
        preempted[0] += 1
        preempt(seq)

    sched._preempt = counting
    outs = llm.generate([*prompts[3:7], prompts[0]], [*older, SEEDED])
    return outs[-1].token_ids, preempted[0]


SQUEEZES = {
    "budget-14": dict(max_num_batched_tokens=14),
    "budget-64": dict(max_num_batched_tokens=64),
    # 8 blocks of 16 cannot avoid a preemption whatever the draft lengths: all five requests are
    # admitted in the first step, and the first of the older four to finish holds 6 blocks
    # (>= 85 tokens) while the other three hold at least one each. (20 blocks preempted or not
    # depending on how fast lookup let the requests race, which adaptive k makes timing-dependent.)
    # The longest request is 110 tokens, so max_model_len 112 fits it and lets 8 blocks load.
    "kv-8-blocks": dict(num_kv_blocks=8, max_model_len=112),
}


@pytest.mark.parametrize("k", [4, None], ids=["k=4", "adaptive"])
@pytest.mark.parametrize("method", ["draft_model", "hybrid", "ngram"])
@pytest.mark.parametrize("squeeze", SQUEEZES.values(), ids=SQUEEZES.keys())
def test_seeded_request_is_unchanged_by_its_neighbours_budget_cache_and_speculation(
    method, k, squeeze, model_sets, tokenizer_dir, alone_without_speculation
):
    ms = model_sets["llama"]
    ref = Reference(ms.target)
    prompt = prompts_for(tokenizer_dir)[0]
    llm = llm_for(ms, method, k, **squeeze)
    alone = llm.generate([prompt], SEEDED)[0].token_ids
    beside, preempted = crowded(llm, tokenizer_dir)
    if "num_kv_blocks" in squeeze:
        assert preempted > 0, "the small cache must preempt, or this tests nothing"
    assert llm.stats().num_draft_tokens > 0 or method == "ngram" or k is None, "nothing was drafted"
    for label, got in (("alone", alone), ("beside older requests", beside)):
        assert_same_sample_unless_near_tie(ref, prompt, got, alone_without_speculation, SEED, TEMPERATURE, TOP_P,
                                           f"{method} k={k} {squeeze} {label} vs speculation off")
