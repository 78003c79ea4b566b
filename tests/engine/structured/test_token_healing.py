"""Token healing: the prompt's last token is backed off, the first generated tokens re-spell it, and the
client sees only what follows its prompt. In the tiny tokenizer "\\n" followed by "   " is one token
("\\n   "), so a prompt that ends in a newline is the case healing exists for."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from engine import LLM, Constraint, SamplingParams
from engine.types.errors import SamplingParamError

MERGED = "\n   "  # one token in the tiny tokenizer: what a prompt ending in "\n" is cut short of
PROMPTS = ["def fib(n):\n", "class Point:\n    def", "for i in range(10):\n", "x = [1, 2, ", "import os\n"]
SETTINGS = {
    "none": dict(speculative_method="none"),
    "draft_model/k=4": dict(speculative_method="draft_model", num_speculative_tokens=4),
    "ngram/k=4": dict(speculative_method="ngram", num_speculative_tokens=4),
    "hybrid/adaptive": dict(speculative_method="hybrid"),
}
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, token_healing=True)


@pytest.fixture(scope="module")
def tok(tokenizer_dir) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def llm(model_sets) -> LLM:
    ms = model_sets["llama"]
    return LLM(model=str(ms.target), draft_model=str(ms.draft), num_speculative_tokens=4, dtype="float32",
               device="cpu", block_size=4)


def healed_text(tok: PreTrainedTokenizerFast, prompt: str) -> str:
    return tok.decode(tok.encode(prompt)[-1:])


def test_the_tiny_tokenizer_merges_a_newline_with_the_next_lines_indentation(tok):
    """The premise of the other tests: the prompt's own tokens are not a prefix of its continuation's."""
    cut, whole = tok.encode("def fib(n):\n"), tok.encode("def fib(n):\n    return n")
    assert whole[: len(cut)] != cut and tok.encode(MERGED) == [tok.convert_tokens_to_ids(tok.tokenize(MERGED))[0]]


def test_healing_lets_the_first_token_merge_with_the_prompts_end_and_never_repeats_it(llm, tok):
    merged = tok.encode(MERGED)[0]
    prompt = "def fib(n):\n"
    ids = tok.encode(prompt)
    # The bias makes the merged token the model's choice; only healing lets it stand for the prompt's "\n".
    params = SamplingParams(max_tokens=6, temperature=0.0, logit_bias={merged: 100.0}, token_healing=True)
    out = llm.generate(prompt, params)[0]
    assert out.token_ids[0] == merged
    assert out.text.startswith("   ") and not out.text.startswith("\n")
    # Prompt and completion, re-tokenized, read as the model wrote them: the natural tokenization.
    assert tok.encode(prompt + out.text)[: len(ids)] == ids[:-1] + [merged]
    plain = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0, logit_bias={merged: 100.0}))[0]
    assert plain.text.startswith(MERGED)  # without healing the newline is doubled


@pytest.mark.parametrize("prompt", PROMPTS)
def test_the_output_is_what_follows_the_prompt_and_token_ids_re_spell_the_healed_text(llm, tok, prompt):
    ids = tok.encode(prompt)
    out = llm.generate(prompt, GREEDY)[0]
    s = healed_text(tok, prompt)
    generated = tok.decode(out.token_ids)
    assert generated.startswith(s), "the generated tokens must begin with the healed text"
    assert generated[len(s):] == out.text
    assert tok.decode(ids[:-1] + out.token_ids) == prompt + out.text
    assert out.prompt_token_ids == ids
    assert len(out.logprobs) == 0 and len(out.token_ids) == GREEDY.max_tokens


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s != "none"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_with_healing_is_the_same_with_speculation_on_and_off(model_sets, tok, arch, setting):
    ms = model_sets[arch]
    outs = {}
    for name in ("none", setting):
        kw = SETTINGS[name]
        llm = LLM(model=str(ms.target), draft_model=str(ms.draft) if kw["speculative_method"] in
                  ("draft_model", "hybrid") else None, dtype="float32", device="cpu", block_size=4, **kw)
        outs[name] = [(o.token_ids, o.text) for o in llm.generate(PROMPTS, GREEDY)]
        if name != "none":
            assert llm.stats().num_draft_tokens > 0, "nothing was drafted: the test proved nothing"
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    assert outs[setting] == outs["none"]


def test_streamed_deltas_add_up_to_the_final_text_and_usage_counts_the_original_prompt(llm, tok):
    engine = llm.engine
    params = SamplingParams(max_tokens=20, temperature=0.0, token_healing=True, logprobs=1, stop=("):",))
    finals = llm.generate(PROMPTS, params)
    for i, (prompt, final) in enumerate(zip(PROMPTS, finals)):
        rid = f"stream-{i}"
        engine.add_request(rid, prompt, params)
        deltas, tokens, seen = [], [], None
        while seen is None or not seen.finished:
            for out in engine.step():
                assert out.request_id == rid
                deltas.append(out.new_text)
                tokens.extend(out.new_token_ids)
                seen = out
        assert "".join(deltas) == final.text and tokens == final.token_ids
        assert seen.num_prompt_tokens == len(tok.encode(prompt))
        assert seen.num_output_tokens == len(final.token_ids) == len(final.logprobs)
        assert [lp.token_id for lp in final.logprobs] == final.token_ids


def test_a_stop_string_never_matches_inside_the_healed_text(llm, tok):
    merged = tok.encode(MERGED)[0]
    prompt = "def fib(n):\n"
    bias = {merged: 100.0}
    free = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, logit_bias=bias,
                                               token_healing=True))[0]
    stopped = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, logit_bias=bias,
                                                  token_healing=True, stop=("\n",)))[0]
    # The first token re-spells the prompt's "\n" (and more): that newline is the prompt's, not a stop.
    assert stopped.token_ids[0] == merged and stopped.text
    assert free.text.startswith(stopped.text) and "\n" not in stopped.text
    if "\n" in free.text:
        assert stopped.finish_reason == "stop" and stopped.text == free.text[: free.text.index("\n")]


def test_a_one_token_prompt_is_not_healed(llm, tok):
    prompt = tok.decode(tok.encode("def")[:1])
    assert len(tok.encode(prompt)) == 1
    healed = llm.generate(prompt, GREEDY)[0]
    plain = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert (healed.token_ids, healed.text) == (plain.token_ids, plain.text)


def test_healing_with_structured_output_is_refused_naming_token_healing():
    with pytest.raises(SamplingParamError) as err:
        SamplingParams(constraint=Constraint.regex("[a-z]+"), token_healing=True)
    assert err.value.param == "token_healing"
