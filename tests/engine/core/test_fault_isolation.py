"""One request's failure stays its own: non-finite logits for one sequence, or a detokenizer error on its text,
finish that sequence with finish_reason "error" (blocks freed) while the rest of the batch decodes on, unchanged.
A request that could never fit the KV cache is refused up front instead of waiting forever."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sched.block_manager import BlockManager
from tests.engine.lossless import Reference, assert_equal_unless_near_tie, assert_same_as_target, prompts_for

POISON = [283, 284, 285, 286]  # a prompt that starts with these ids is the one that fails
MAX_NEW = 32


@pytest.fixture(scope="module")
def llm(model_sets) -> LLM:
    ms = model_sets["llama"]
    return LLM(str(ms.target), draft_model=str(ms.draft), num_speculative_tokens=4, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def ref(model_sets) -> Reference:
    return Reference(model_sets["llama"].target)


def poisoned(seq) -> bool:
    return seq.token_ids[: len(POISON)] == POISON


def run_with_one_poisoned(llm: LLM, tokenizer_dir, ref: Reference) -> None:
    prompts = prompts_for(tokenizer_dir)[:6]
    batch = [*prompts[:3], POISON + [5, 6, 7], *prompts[3:]]
    outs = llm.generate(batch, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    assert outs[3].finish_reason == "error"
    for i, (p, o) in enumerate(zip(batch, outs)):
        if i != 3:
            assert o.finish_reason in ("stop", "length")
            assert_same_as_target(ref, p, o.token_ids, f"prompt {i} next to a failing one")
    engine = llm.engine
    assert not engine.seqs and not engine.has_unfinished() and engine.block_manager.usage == 0


def test_nan_logits_fail_only_their_own_sequence(llm, ref, tokenizer_dir, monkeypatch):
    engine = llm.engine
    forward = engine._forward

    def nan_for_the_poisoned(scheduled, drafts):
        logits = forward(scheduled, drafts)
        row = 0
        for s, d in zip(scheduled, drafts):
            r = len(d) + 1 if s.samples else 0
            if r and poisoned(s.seq) and s.seq.num_output_tokens >= 3:  # mid-flight, after a few tokens
                logits[row : row + r] = float("nan")
            row += r
        return logits

    monkeypatch.setattr(engine, "_forward", nan_for_the_poisoned)
    run_with_one_poisoned(llm, tokenizer_dir, ref)


# Plain greedy steps take the verifier's fast path; asking for logprobs takes its tensor path.
@pytest.mark.parametrize("logprobs", [None, 1], ids=["greedy fast path", "tensor path"])
def test_positive_infinity_and_all_minus_infinity_rows_fail_too_but_a_masked_token_does_not(
    llm, ref, monkeypatch, logprobs
):
    engine = llm.engine
    forward = engine._forward
    kinds = iter(["+inf", "-inf row", "-inf one"])
    poison_of = {}

    def inject(scheduled, drafts):
        logits = forward(scheduled, drafts)
        row = 0
        for s, d in zip(scheduled, drafts):
            r = len(d) + 1 if s.samples else 0
            if r and poisoned(s.seq):
                if s.seq.request_id not in poison_of:
                    poison_of[s.seq.request_id] = next(kinds)
                kind = poison_of[s.seq.request_id]
                if kind == "+inf":
                    logits[row, 7] = float("inf")
                elif kind == "-inf row":
                    logits[row : row + r] = float("-inf")
                else:
                    logits[row : row + r, 300] = float("-inf")  # a padding row of the vocabulary, masked
            row += r
        return logits

    monkeypatch.setattr(engine, "_forward", inject)
    prompts = [POISON + [i] for i in (10, 11, 12)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, logprobs=logprobs))
    reasons = {poison_of[o.request_id]: o.finish_reason for o in outs}
    assert reasons == {"+inf": "error", "-inf row": "error", "-inf one": "length"}
    assert_equal_unless_near_tie(ref, prompts[2], outs[2].token_ids, ref.greedy(prompts[2], 8), "masked token")


def test_a_detokenizer_error_fails_only_its_own_sequence(llm, ref, tokenizer_dir, monkeypatch):
    engine = llm.engine
    check = engine.scheduler.stop.check

    def failing_check(seq, token):
        if poisoned(seq) and seq.num_output_tokens >= 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return check(seq, token)

    monkeypatch.setattr(engine.scheduler.stop, "check", failing_check)
    run_with_one_poisoned(llm, tokenizer_dir, ref)


def test_the_library_rejects_a_prompt_that_could_never_fit_the_kv_cache(llm, monkeypatch):
    engine = llm.engine
    small = BlockManager(4, engine.block_manager.block_size)  # 64 tokens: less than one context
    monkeypatch.setattr(engine, "block_manager", small)
    monkeypatch.setattr(engine.scheduler, "block_manager", small)
    with pytest.raises(ValueError, match=r"\(60 tokens\) plus max_tokens \(10\) is 70 tokens, .* \(64 tokens\)"):
        llm.generate([[5] * 4, [5] * 60], SamplingParams(max_tokens=10, temperature=0.0))
    assert not engine.seqs and not engine.has_unfinished(), "the first prompt was not left behind"
    out = llm.generate([[5] * 50], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 10 and small.usage == 0


def test_finite_logits_pass_through_without_a_copy(llm, monkeypatch):
    verifier, seen = llm.engine.verifier, []
    monkeypatch.setattr(verifier, "_verify", lambda seqs, drafts, probs, logits: seen.append(logits) or [])
    logits = torch.randn(5, 320)
    sampled = SimpleNamespace(params=SamplingParams(temperature=1.0), grammar=None)  # not the greedy fast path
    verifier([sampled], [[0, 1, 2, 3]], None, logits)  # one sequence with four drafts: five rows
    assert seen[0] is logits
