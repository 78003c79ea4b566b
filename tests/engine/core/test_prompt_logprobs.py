"""Prompt logprobs in the engine: exact against a plain transformers forward of the prompt alone, whatever the
chunking, batching, preemption or speculation; a prompt scored alone (max_tokens 0); the prefix cache untouched."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from tests.engine.lossless import prompts_for
from tests.tiny_models import ARCHS

TOL = 1e-4  # float32 both sides; the engine's packed, paged, chunked forward sums in another order


@torch.inference_mode()
def reference(model_dir, ids: list[int]) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def check(out, model_dir, ids: list[int], top: int) -> None:
    scores = out.prompt_logprobs
    assert len(scores) == len(ids) and scores[0] is None
    want = reference(model_dir, ids)
    for i, (s, w) in enumerate(zip(scores[1:], want)):
        assert s.token_id == ids[i + 1] and abs(s.logprob - w) < TOL, (i, s.logprob, w)
        assert len(s.top) == top and s.rank >= 1
        if top:  # the best alternative scores at least the prompt's token, and equals it where that ranks first
            assert s.top[0][1] >= s.logprob - TOL and (s.rank > 1 or abs(s.top[0][1] - s.logprob) < TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logprobs_equal_a_plain_forward_over_chunks_and_a_batch_and_speculation_is_unchanged(
        arch, model_sets, tokenizer_dir):
    ms = model_sets[arch]
    # 7 tokens a step: every prompt is scored over several chunks, some of them mid-block.
    llm = LLM(model=str(ms.target), draft_model=str(ms.draft), dtype="float32", device="cpu", block_size=4,
              max_num_batched_tokens=7, num_speculative_tokens=3)
    prompts = prompts_for(tokenizer_dir)
    plain = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    scored = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, prompt_logprobs=2))
    for ids, a, b in zip(prompts, plain, scored):
        assert b.token_ids == a.token_ids and a.prompt_logprobs is None
        check(b, ms.target, ids, 2)
    assert llm.stats().num_draft_tokens > 0


def test_a_prompt_scored_alone_samples_nothing_and_reads_no_cached_block(model_sets, tokenizer_dir):
    ms = model_sets["llama"]
    llm = LLM(model=str(ms.target), speculative_method="none", dtype="float32", device="cpu", block_size=4)
    ids = prompts_for(tokenizer_dir)[0] * 3
    warm = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0.0))[0]
    again = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert again.num_cached_tokens > 0 and warm.num_cached_tokens == 0
    alone = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert alone.token_ids == [] and alone.finish_reason == "length" and alone.num_cached_tokens == 0
    check(alone, ms.target, ids, 0)
    after = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert after.num_cached_tokens == again.num_cached_tokens and after.token_ids == again.token_ids
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_preempted_and_recomputed_prompts_are_scored_once(model_sets, tokenizer_dir):
    """19 blocks of 4 tokens hold about one and a half sequences: eight at once must preempt and recompute."""
    ms = model_sets["llama"]
    llm = LLM(model=str(ms.target), draft_model=str(ms.draft), num_speculative_tokens=4, dtype="float32",
              device="cpu", max_model_len=64, block_size=4, num_kv_blocks=19)
    prompts = prompts_for(tokenizer_dir)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, prompt_logprobs=1, ignore_eos=True))
    assert llm.stats().num_preempted > 0, "nothing was preempted, so this test proved nothing"
    for ids, out in zip(prompts, outs):
        check(out, ms.target, ids, 1)


def test_a_scored_prompt_is_computed_in_chunks_no_larger_than_the_logits_the_plan_reserves(model_sets):
    ms = model_sets["llama"]
    llm = LLM(model=str(ms.target), speculative_method="none", dtype="float32", device="cpu", max_num_seqs=2)
    engine, chunks = llm.engine, []
    schedule = engine.scheduler.schedule

    def recorded():  # noqa: ANN202
        out = schedule()
        chunks.extend(s.num_new_tokens for s in out.scheduled if s.seq.params.prompt_logprobs is not None)
        return out

    engine.scheduler.schedule = recorded
    ids = [(7 * i) % 300 + 3 for i in range(400)]
    out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert engine.scheduler.config.logit_rows == 256 and max(chunks) == 256 and sum(chunks) == len(ids)
    check(out, ms.target, ids, 0)
