"""/v1/completions through the official openai client: plain, streamed, n > 1, stop, echo,
logprobs, token-id prompts, seeds, usage."""

from __future__ import annotations

import openai
import pytest
from transformers import PreTrainedTokenizerFast

from tests.server.conftest import MODEL

pytestmark = pytest.mark.timeout(60)

PROMPT = "def fib(n):"
GREEDY = dict(model=MODEL, temperature=0.0)
EXTENSIONS = {"ignore_eos", "return_token_ids", "num_speculative_tokens", "min_tokens", "top_k", "min_p"}


def ext(kw: dict) -> dict:
    """Move specd's extension fields into extra_body, where the openai client sends them from."""
    body = {k: kw.pop(k) for k in list(kw) if k in EXTENSIONS}
    return {**kw, "extra_body": body} if body else kw


def complete(client, **kw):
    return client.completions.create(**ext(kw))


def streamed(client, **kw) -> tuple[dict[int, str], dict[int, str], list]:
    """Texts and finish reasons per choice index, and every chunk."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    chunks = list(client.completions.create(stream=True, **ext(kw)))
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return texts, finish, chunks


def test_completion_has_openai_fields_and_usage_with_spec_counts(server):
    resp = complete(server.client(), prompt=PROMPT, max_tokens=12, ignore_eos=True, **GREEDY)
    assert resp.object == "text_completion" and resp.model == MODEL and resp.id.startswith("cmpl-")
    assert resp.created > 0
    [choice] = resp.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.logprobs is None
    assert resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12
    extra = resp.usage.model_extra
    assert extra["spec_draft_tokens"] > 0, "the shared server drafts 4 tokens per step"
    assert 0 <= extra["spec_accepted_tokens"] <= extra["spec_draft_tokens"]


def test_default_max_tokens_is_16(server):
    resp = complete(server.client(), model=MODEL, prompt=PROMPT, temperature=0.0, ignore_eos=True)
    assert resp.usage.completion_tokens == 16


def test_stream_concatenates_to_the_plain_completion_and_reports_usage_last(server):
    client = server.client()
    plain = complete(client, prompt=PROMPT, max_tokens=30, ignore_eos=True, **GREEDY)
    texts, finish, chunks = streamed(
        client, prompt=PROMPT, max_tokens=30, stream_options={"include_usage": True},
        ignore_eos=True, **GREEDY,
    )
    assert texts == {0: plain.choices[0].text} and finish == {0: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_n_choices_are_separate_requests_with_their_own_index(server):
    client = server.client()
    kw = dict(prompt=PROMPT, max_tokens=20, n=3, ignore_eos=True, **GREEDY)
    resp = complete(client, **kw)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert len({c.text for c in resp.choices}) == 1, "greedy choices agree"
    assert resp.usage.completion_tokens == 60
    texts, finish, _ = streamed(client, **kw)
    del texts  # streamed choices interleave; each must finish
    assert finish == {0: "length", 1: "length", 2: "length"}


def test_list_prompts_give_n_choices_each_in_prompt_order(server):
    resp = complete(server.client(),
        prompt=["for i in", "class Point:"], max_tokens=5, n=2, ignore_eos=True, **GREEDY
    )
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.choices[0].text == resp.choices[1].text and resp.choices[2].text == resp.choices[3].text


def test_token_id_prompts_equal_their_text(server):
    client = server.client()
    ids = server.engine.tokenizer.encode(PROMPT)
    by_text = complete(client, prompt=PROMPT, max_tokens=10, **GREEDY)
    by_ids = complete(client, prompt=ids, max_tokens=10, **GREEDY)
    batch = complete(client, prompt=[ids, ids[:3]], max_tokens=10, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text == batch.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    assert batch.usage.prompt_tokens == len(ids) + 3


def test_stop_string_ends_the_text_before_it(server):
    client = server.client()
    full = complete(client, prompt=PROMPT, max_tokens=40, ignore_eos=True, **GREEDY).choices[0].text
    cut = next(i for i in range(3, len(full) - 2) if full[i : i + 2] not in full[: i + 1])
    stop = full[cut : cut + 2]
    resp = complete(client, prompt=PROMPT, max_tokens=40, stop=[stop, "never-there"], ignore_eos=True, **GREEDY)
    assert resp.choices[0].text == full[:cut]
    assert resp.choices[0].finish_reason == "stop"
    texts, finish, _ = streamed(client, prompt=PROMPT, max_tokens=40, stop=stop, ignore_eos=True, **GREEDY)
    assert texts == {0: full[:cut]} and finish == {0: "stop"}


def test_echo_prepends_the_prompt_and_its_first_token_alone_gets_a_null_logprob(server):
    client = server.client()
    plain = complete(client, prompt=PROMPT, max_tokens=6, **GREEDY).choices[0].text
    resp = complete(client, prompt=PROMPT, max_tokens=6, echo=True, logprobs=2, **GREEDY)
    choice = resp.choices[0]
    assert choice.text == PROMPT + plain
    n_prompt = resp.usage.prompt_tokens
    lp = choice.logprobs
    assert len(lp.tokens) == n_prompt + resp.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing before it to score it by
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:n_prompt])  # tests/server/test_prompt_logprobs
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:n_prompt])  # ids that print alike share a key
    assert "".join(lp.tokens[:n_prompt]) == PROMPT
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    texts, _, _ = streamed(client, prompt=PROMPT, max_tokens=6, echo=True, **GREEDY)
    assert texts == {0: PROMPT + plain}


def test_logprobs_follow_the_legacy_format_and_streaming_gives_the_same(server):
    client = server.client()
    kw = dict(prompt=PROMPT, max_tokens=10, logprobs=3, ignore_eos=True, **GREEDY)
    lp = complete(client, **kw).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and chosen <= 0.0
        assert chosen == pytest.approx(max(top.values()), abs=1e-5), "greedy picks the top token"
    assert lp.text_offset == sorted(lp.text_offset)
    _, _, chunks = streamed(client, **kw)
    got = [x for ch in chunks for c in ch.choices if c.logprobs for x in c.logprobs.token_logprobs]
    assert got == pytest.approx(lp.token_logprobs, abs=1e-6)
    zero = complete(client, **{**kw, "logprobs": 0}).choices[0].logprobs
    assert zero.top_logprobs == [{}] * 10


def test_seed_reproduces_a_sample_and_n_choices_use_seed_plus_index(server):
    client = server.client()
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=1.0, ignore_eos=True)
    a = complete(client, seed=7, **kw).choices[0].text
    b = complete(client, seed=7, **kw).choices[0].text
    other = complete(client, seed=8, **kw).choices[0].text
    assert a == b and a != other
    both = complete(client, seed=7, n=2, **kw).choices
    assert [c.text for c in both] == [a, other]


def test_return_token_ids_extension(server):
    resp = complete(server.client(),
        prompt=PROMPT, max_tokens=5, ignore_eos=True, return_token_ids=True, **GREEDY
    )
    extra = resp.choices[0].model_extra
    assert extra["prompt_token_ids"] == server.engine.tokenizer.encode(PROMPT)
    assert len(extra["token_ids"]) == 5


def test_num_speculative_tokens_zero_turns_drafting_off_for_the_request(server):
    client = server.client()
    on = complete(client, prompt=PROMPT, max_tokens=20, ignore_eos=True, **GREEDY)
    off = complete(client, prompt=PROMPT, max_tokens=20, ignore_eos=True, num_speculative_tokens=0, **GREEDY)
    assert off.usage.model_extra["spec_draft_tokens"] == 0 and on.usage.model_extra["spec_draft_tokens"] > 0
    assert off.choices[0].text == on.choices[0].text


def test_models_health_and_metrics(server):
    models = server.client().models.list().data
    assert [m.id for m in models] == [MODEL]
    card = models[0].model_extra
    assert models[0].owned_by == "specd" and card["root"].endswith(MODEL)
    assert card["draft_model"].endswith("llama-draft") and card["speculative_method"] == "draft_model"
    assert server.client().models.retrieve(MODEL).id == MODEL
    assert server.get("/health").json() == {"status": "ready", "compile": "off"}
    assert server.metric("specd:compile_state", model_name=MODEL, state="off") == 1.0
    assert server.metric("specd:compile_state", model_name=MODEL, state="compiling") == 0.0
    assert server.metric("specd:uncompiled_forwards_total", model_name=MODEL) == 0.0
    before = server.metric("specd:generation_tokens_total", model_name=MODEL)
    drafted = server.metric("specd:spec_decode_num_draft_tokens_total", model_name=MODEL)
    complete(server.client(), prompt=PROMPT, max_tokens=8, ignore_eos=True, **GREEDY)
    assert server.metric("specd:generation_tokens_total", model_name=MODEL) == before + 8
    assert server.metric("specd:spec_decode_num_draft_tokens_total", model_name=MODEL) > drafted
    assert server.metric("specd:request_success_total", model_name=MODEL, finish_reason="length") >= 1


def test_stream_options_without_stream_is_refused_by_name(server):
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(
            prompt=PROMPT, max_tokens=2, stream_options={"include_usage": True}, **GREEDY
        )
    assert info.value.body["param"] == "stream_options"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_completion_ending_inside_an_incomplete_character_keeps_its_text(server, tokenizer_dir, stream):
    """A byte that starts a three-byte character, forced three times: the text is what the tokenizer
    renders for those ids (replacement characters), not an empty string."""
    tok = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    lead = tok.encode("書")[0]
    assert tok.decode([lead]).endswith("\ufffd")
    kw = dict(prompt=PROMPT, max_tokens=3, logit_bias={str(lead): 100}, return_token_ids=True, **GREEDY)
    if stream:
        texts, finish, chunks = streamed(server.client(), **kw)
        text = texts[0]
        ids = [t for c in chunks for ch in c.choices for t in (ch.model_extra or {}).get("token_ids") or []]
    else:
        choice = complete(server.client(), **kw).choices[0]
        text, ids = choice.text, choice.model_extra["token_ids"]
    assert ids == [lead] * 3
    assert text == tok.decode(ids) and text
