"""Engine-level scenarios: rollback, seeds, logprobs, penalties, stops, errors, abort."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.core.loader import TokenizerMismatchError
from tests.engine.lossless import prompts_for
from tests.tiny_models import build_tokenizer, save_model, tiny_config


def llm_for(ms, method="draft_model", k=4, draft=None, **kw) -> LLM:
    return LLM(
        model=str(ms.target),
        draft_model=str(draft or ms.draft) if method in ("draft_model", "hybrid") else None,
        speculative_method=method,
        num_speculative_tokens=k,
        dtype="float32",
        device="cpu",
        **kw,
    )


@torch.inference_mode()
def _cache_matches_fresh_prefill(runner, model_dir, seq, n) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    past = model(torch.tensor([seq.token_ids[:n]]), use_cache=True).past_key_values
    slots = torch.tensor(runner.cache.slots(seq.block_table, 0, n))
    for layer in range(len(runner.cache.k)):
        want_k = past.layers[layer].keys[0].transpose(0, 1)  # [n, Hkv, D]
        want_v = past.layers[layer].values[0].transpose(0, 1)
        torch.testing.assert_close(runner.cache.k[layer][slots], want_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(runner.cache.v[layer][slots], want_v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["draft_model", "self"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_rejected_drafts_roll_back_and_the_cache_equals_a_fresh_prefill(arch, method, model_sets, tokenizer_dir):
    """With "self", drafting wrote the first layer's K/V at every draft position of the target's own cache:
    verification must have overwritten each one the sequence kept with the target's."""
    ms = model_sets[arch]
    llm = llm_for(ms, method=method, k=4, draft_layers=1 if method == "self" else None)
    engine = llm.engine
    for i, p in enumerate(prompts_for(tokenizer_dir)[:4]):
        engine.add_request(str(i), p, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    for _ in range(12):
        engine.step()
    stats = llm.stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, "need a mix of accepts and rejects"
    for seq in engine.scheduler.running:
        assert seq.num_computed == seq.num_tokens - 1
        _cache_matches_fresh_prefill(engine.target, ms.target, seq, seq.num_computed)
        draft = engine.drafting.source("draft_model")
        if draft is not None:
            _cache_matches_fresh_prefill(draft.runner, ms.draft, seq, seq.draft_num_computed)
    for rid in list(engine.seqs):
        engine.abort(rid)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("k", [4, None], ids=["k=4", "adaptive"])
@pytest.mark.parametrize("method", ["draft_model", "ngram", "hybrid"])
def test_seeded_request_gives_the_same_output_whatever_shares_its_batch(method, k, model_sets, tokenizer_dir):
    llm = llm_for(model_sets["llama"], method=method, k=k)
    prompts = prompts_for(tokenizer_dir)
    seeded = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.95, seed=42, ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded)[0].token_ids
    others = [SamplingParams(max_tokens=n, temperature=0.8, ignore_eos=True) for n in (5, 60, 17, 33)]
    crowded = llm.generate([prompts[3], prompts[0], *prompts[4:7]], [others[0], seeded, *others[1:]])[1].token_ids
    again = llm.generate([prompts[0], prompts[1]], [seeded, others[1]])[0].token_ids
    assert alone == crowded == again
    different_seed = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.95, seed=43, ignore_eos=True)
    assert llm.generate([prompts[0]], different_seed)[0].token_ids != alone


@pytest.mark.parametrize("method", ["draft_model", "ngram", "hybrid"])
def test_logprobs_are_the_targets_with_and_without_speculation(method, model_sets, tokenizer_dir):
    ms = model_sets["qwen3"]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=3)
    prompts = prompts_for(tokenizer_dir)
    spec = llm_for(ms, method=method, k=4).generate(prompts, params)
    plain = llm_for(ms, method="none", k=None).generate(prompts, params)
    for a, b in zip(spec, plain):
        assert a.token_ids == b.token_ids
        assert len(a.logprobs) == len(a.token_ids)
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token_id == y.token_id
            assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=1e-5)
            assert x.logprob <= x.top[0][1] + 1e-6  # nothing beats the top alternative


@pytest.mark.parametrize("method", ["draft_model", "ngram", "hybrid"])
def test_penalties_logit_bias_and_min_tokens_apply_without_breaking_losslessness(method, model_sets, tokenizer_dir):
    """The target alone with the same transforms is the speculation-off engine; drafts must not
    change a single token, because each verify row sees the drafts before it as generated tokens."""
    ms = model_sets["llama"]
    prompts = prompts_for(tokenizer_dir)
    params = SamplingParams(
        max_tokens=32, temperature=0.0, presence_penalty=0.7, frequency_penalty=1.3,
        logit_bias={5: 3.0, 6: -100.0, 250: 2.0}, min_tokens=20,
    )
    plain = llm_for(ms, method="none", k=None).generate(prompts, params)
    spec_llm = llm_for(ms, method=method, k=4)
    spec = spec_llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec_llm.stats().num_draft_tokens > 0
    assert all(len(o.token_ids) >= 20 for o in spec)
    assert all(6 not in o.token_ids for o in spec)
    # The penalties really changed the output (otherwise this test would prove nothing).
    unpenalised = llm_for(ms, method="none", k=None).generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))
    assert [o.token_ids for o in unpenalised] != [o.token_ids for o in plain]


def test_stop_string_across_token_boundaries_is_never_emitted(model_sets, tokenizer_dir):
    ms = model_sets["llama"]
    llm = llm_for(ms, method="ngram", k=4)
    prompt = prompts_for(tokenizer_dir)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    tok = llm.engine.tokenizer
    # A stop string made of the end of one token's text and the start of the next one's.
    pieces = [tok.decode([t], skip_special_tokens=True) for t in free.token_ids]
    i = next(i for i in range(3, len(pieces) - 1)
             if pieces[i].strip() and pieces[i + 1].strip() and "\ufffd" not in pieces[i] + pieces[i + 1])
    stop = pieces[i][-1] + pieces[i + 1][:1]
    cut = free.text.find(stop)
    out = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[:cut]
    assert stop not in out.text


def test_stop_token_id_ends_the_request_and_max_tokens_gives_length(model_sets, tokenizer_dir):
    ms = model_sets["llama"]
    llm = llm_for(ms, k=4)
    prompt = prompts_for(tokenizer_dir)[1]
    free = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    stop_id = free.token_ids[7]
    first = free.token_ids.index(stop_id)
    out = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == free.token_ids[: first + 1]


def test_context_limit_finishes_with_length(model_sets, tokenizer_dir):
    llm = llm_for(model_sets["llama"], k=4, max_model_len=40)
    prompt = prompts_for(tokenizer_dir)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(prompt) + len(out.token_ids) == 40


def test_prompt_longer_than_the_context_is_a_value_error_naming_both_numbers(model_sets):
    llm = llm_for(model_sets["llama"], k=4, max_model_len=40)
    with pytest.raises(ValueError, match=r"45 tokens.*40"):
        llm.generate([[7] * 45], SamplingParams(max_tokens=4))


def test_token_ids_outside_the_vocabulary_are_a_value_error(model_sets):
    llm = llm_for(model_sets["llama"], method="none", k=None)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 99999]], SamplingParams(max_tokens=4))


def test_abort_frees_every_block_and_the_engine_keeps_serving(model_sets, tokenizer_dir):
    llm = llm_for(model_sets["llama"], k=4)
    engine = llm.engine
    prompts = prompts_for(tokenizer_dir)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=50, temperature=0.0))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    assert all(engine.abort(f"r{i}") for i in range(0, 8, 2))
    assert not engine.abort("r0") and not engine.abort("nope")
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.seqs == {}
    assert llm.generate([prompts[0]], SamplingParams(max_tokens=3, temperature=0.0))[0].finish_reason


def test_draft_with_a_different_tokenizer_is_rejected_at_load(model_sets, tmp_path):
    other_tok = tmp_path / "tok"
    build_tokenizer(other_tok)
    # Retrain on a different corpus so the vocabularies really differ.
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["zzz yyy xxx www"] * 10, trainers.BpeTrainer(vocab_size=280, show_progress=False,
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    draft = tmp_path / "draft"
    shutil.copytree(model_sets["llama"].draft, draft)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(draft)
    with pytest.raises(TokenizerMismatchError, match="does not share the target's tokenizer"):
        llm_for(model_sets["llama"], draft=draft)


def test_draft_whose_vocabulary_differs_only_by_padding_rows_is_lossless(model_sets, tokenizer_dir, tmp_path):
    ms = model_sets["llama"]
    cfg = tiny_config("llama")
    cfg.vocab_size = 384  # padded further than the target's 320; same tokenizer
    save_model(cfg, tmp_path / "padded", seed=9, tokenizer_dir=tokenizer_dir)
    prompts = prompts_for(tokenizer_dir)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    want = llm_for(ms, method="none", k=None).generate(prompts, params)
    got = llm_for(ms, draft=tmp_path / "padded").generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_adaptive_k_mostly_stops_drafting_with_a_useless_drafter(model_sets, tokenizer_dir):
    """An unrelated same-size draft never pays: after a few steps only the periodic probes draft."""
    ms = model_sets["llama"]
    llm = llm_for(ms, draft=ms.unrelated, k=None)
    prompt = prompts_for(tokenizer_dir)[0]
    llm.generate([prompt], SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True))
    stats = llm.stats()
    assert stats.num_drafts <= 120 / 4, f"drafted on {stats.num_drafts} of ~120 steps"


def test_a_bad_prompt_in_a_batch_queues_nothing(model_sets, tokenizer_dir):
    llm = llm_for(model_sets["llama"], method="none", k=None, max_model_len=40)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([prompts_for(tokenizer_dir)[0], [1, 99999]], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_draft_timings_do_not_pile_up_with_a_fixed_k(model_sets, tokenizer_dir):
    """With a fixed k there is no adaptive policy to consume draft timings; a long-running server
    must not keep one entry per draft forward forever."""
    llm = llm_for(model_sets["llama"], k=4)
    llm.generate(prompts_for(tokenizer_dir), SamplingParams(max_tokens=24, temperature=0.0))
    assert llm.stats().num_draft_tokens > 0
    assert llm.engine.drafting.source("draft_model").drain_costs() == []
