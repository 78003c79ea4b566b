"""/v1/chat/completions: template rendering, streaming, n, logprobs, and the missing-template 400."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import CHAT_TEMPLATE, MODEL

pytestmark = pytest.mark.timeout(60)

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def fib(n):"}]
IGNORE_EOS = {"extra_body": {"ignore_eos": True}}


def test_chat_renders_the_template_and_answers_like_the_completion_of_that_text(server):
    client = server.client()
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0.0, **IGNORE_EOS)
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-") and chat.model == MODEL
    [choice] = chat.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length" and choice.logprobs is None
    rendered = "<|bos|>system: be brief\n<|bos|>user: def fib(n):\nassistant:"
    ids = server.engine.tokenizer.encode(rendered, add_special_tokens=False)
    comp = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0.0, **IGNORE_EOS)
    assert choice.message.content == comp.choices[0].text
    assert chat.usage.prompt_tokens == len(ids) and chat.usage.completion_tokens == 12
    assert chat.usage.model_extra["spec_draft_tokens"] > 0


def test_max_completion_tokens_wins_and_the_default_is_the_rest_of_the_context(server):
    client = server.client()
    short = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=30, max_completion_tokens=3, temperature=0.0, **IGNORE_EOS
    )
    assert short.usage.completion_tokens == 3
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0.0, **IGNORE_EOS)
    assert whole.usage.total_tokens == server.engine.max_model_len
    assert whole.choices[0].finish_reason == "length"


def test_streamed_chat_opens_with_the_role_and_ends_with_usage(server):
    client = server.client()
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0.0, n=2)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0.0, n=2, stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    texts = {0: "", 1: ""}
    finish = {}
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {c.index: c.message.content for c in plain.choices}
    assert finish == {c.index: c.finish_reason for c in plain.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_chat_logprobs_have_tokens_bytes_and_top_alternatives(server):
    resp = server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=2, **IGNORE_EOS
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == 8
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        if not entry.token.startswith(("bytes:", "token_id:")):
            assert bytes(entry.bytes).decode() == entry.token
    plain = server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0.0, logprobs=True, **IGNORE_EOS
    )
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)


def test_text_content_parts_are_joined(server):
    client = server.client()
    parts = [{"role": "user", "content": [{"type": "text", "text": "def "}, {"type": "text", "text": "fib(n):"}]}]
    joined = [{"role": "user", "content": "def fib(n):"}]
    a = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=6, temperature=0.0)
    b = client.chat.completions.create(model=MODEL, messages=joined, max_tokens=6, temperature=0.0)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_chat_without_a_template_is_a_clear_400(make_server):
    live = make_server()  # the plain tiny tokenizer: no chat template
    with pytest.raises(openai.BadRequestError) as err:
        live.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    body = err.value.body
    assert body["param"] == "messages" and "chat template" in body["message"]


def test_chat_template_flag_supplies_a_missing_template(make_server, tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(CHAT_TEMPLATE)
    live = make_server(chat_template=str(path))
    resp = live.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **IGNORE_EOS)
    assert resp.usage.completion_tokens == 4
