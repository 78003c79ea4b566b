"""The clients people point at an OpenAI-compatible server, unmodified, against the live server: langchain-openai
(chat invoke and stream, structured output, tools, the completions LLM) and LiteLLM's `openai/` provider
(completion, streaming, text_completion). Greedy throughout, so each answer can be held to the server's own."""

from __future__ import annotations

from typing import Literal

import litellm
import pytest
from langchain_openai import ChatOpenAI, OpenAI
from pydantic import BaseModel

from tests.server.conftest import MODEL

pytestmark = pytest.mark.timeout(120)

MESSAGES = [{"role": "user", "content": "def add(a, b):"}]


class Verdict(BaseModel):
    """Bounded fields: a random model's integers could run past max_tokens, an enum and a bool cannot."""

    ok: bool
    kind: Literal["bug", "feature"]


def test_langchain_chat_invoke_equals_its_stream_and_the_server_alone(server):
    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=12)
    said = llm.invoke("def add(a, b):").content
    assert said == "".join(chunk.content for chunk in llm.stream("def add(a, b):"))
    direct = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12)
    assert said == direct.choices[0].message.content


def test_langchain_structured_output_and_a_bound_tool_come_back_parsed(server):
    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=60)
    point = llm.with_structured_output(Verdict, method="json_schema").invoke("is it a bug?")
    assert isinstance(point, Verdict)
    called = llm.bind_tools([Verdict], tool_choice="Verdict").invoke("is it a bug?")
    assert called.tool_calls and called.tool_calls[0]["name"] == "Verdict"
    Verdict(**called.tool_calls[0]["args"])  # arguments that validate against the tool's schema


def test_langchains_completions_llm_returns_the_servers_text(server):
    llm = OpenAI(base_url=f"{server.url}/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=10)
    direct = server.client().completions.create(model=MODEL, prompt="def fib(n):", temperature=0, max_tokens=10)
    assert llm.invoke("def fib(n):") == direct.choices[0].text


def test_litellm_completion_streaming_and_text_completion_through_the_openai_provider(server):
    common = dict(model=f"openai/{MODEL}", api_base=f"{server.url}/v1", api_key="unused", temperature=0,
                  max_tokens=12)
    whole = litellm.completion(messages=MESSAGES, **common).choices[0].message.content
    parts = litellm.completion(messages=MESSAGES, stream=True, **common)
    assert whole == "".join(chunk.choices[0].delta.content or "" for chunk in parts)
    direct = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12)
    assert whole == direct.choices[0].message.content
    text = litellm.text_completion(prompt="def fib(n):", **common).choices[0].text
    assert text == server.client().completions.create(model=MODEL, prompt="def fib(n):", temperature=0,
                                                      max_tokens=12).choices[0].text
