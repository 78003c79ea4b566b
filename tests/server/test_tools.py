"""Chat tool calling over HTTP: a named function and "required" constrain the output and come back as
tool_calls (finish_reason "tool_calls"), streamed and not, with n > 1; "none" is plain generation; "auto"
needs a template that shows the tools; conversations that carry tool calls and tool results render; the
400s name tools or tool_choice, and the server goes on serving."""

from __future__ import annotations

import json

import jsonschema_rs
import pytest

from tests.server.conftest import CHAT_TEMPLATE, MODEL
from tests.server.test_errors import error_of
from tests.server.test_validation import assert_still_serving

pytestmark = pytest.mark.timeout(120)

MESSAGES = [{"role": "user", "content": "the weather in Oslo?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME, "strict": True}},
]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
SAMPLED = {"temperature": 1.0, "seed": 11}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# Shows the tools' names (as Hermes/Qwen templates show their whole JSON, inside <tools>): "auto" is allowed.
TOOLS_TEMPLATE = (
    "{% if tools %}<|bos|>system: <tools>{% for t in tools %}{{ t.function.name }} {% endfor %}</tools>\n"
    "{% endif %}" + CHAT_TEMPLATE
)


def assert_valid_calls(message, names: set[str]) -> None:
    assert message.content is None and message.tool_calls
    ids = [call.id for call in message.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(ids)
    for call in message.tool_calls:
        assert call.type == "function" and call.function.name in names
        jsonschema_rs.validate(PARAMETERS[call.function.name], json.loads(call.function.arguments))


def streamed_calls(chunks) -> tuple[dict[int, list[dict]], dict[int, str], dict[int, str]]:
    """Each choice's tool calls (as dicts), content and finish_reason, from the streamed chunks."""
    calls: dict[int, list[dict]] = {}
    content: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
            for d in c.delta.tool_calls or []:
                assert d.index == len(calls.setdefault(c.index, [])) and d.type == "function"
                calls[c.index].append({"id": d.id, "name": d.function.name, "arguments": d.function.arguments})
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return calls, content, finish


def test_a_named_tool_call_returns_arguments_that_validate_streamed_and_not(server):
    client = server.client()
    body = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=60, n=2, **SAMPLED)
    resp = client.chat.completions.create(**body)
    assert [c.finish_reason for c in resp.choices] == ["tool_calls", "tool_calls"]
    for c in resp.choices:
        assert_valid_calls(c.message, {"get_weather"})
        assert len(c.message.tool_calls) == 1
    calls, content, finish = streamed_calls(client.chat.completions.create(**body, stream=True))
    assert finish == {0: "tool_calls", 1: "tool_calls"} and set(content.values()) == {""}
    for c in resp.choices:  # the same seeds: the same arguments, under new ids
        [call] = calls[c.index]
        assert call["name"] == "get_weather" and call["arguments"] == c.message.tool_calls[0].function.arguments
        assert call["id"].startswith("call_")


def test_required_makes_at_least_one_call_to_the_given_tools_streamed_and_not(server):
    client = server.client()
    body = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=200, n=3, **SAMPLED)
    resp = client.chat.completions.create(**body)
    assert [c.finish_reason for c in resp.choices] == ["tool_calls"] * 3
    for c in resp.choices:
        assert_valid_calls(c.message, set(PARAMETERS))
    calls, _, finish = streamed_calls(client.chat.completions.create(**body, stream=True))
    assert finish == {0: "tool_calls", 1: "tool_calls", 2: "tool_calls"}
    for c in resp.choices:
        assert [(x["name"], x["arguments"]) for x in calls[c.index]] == [
            (t.function.name, t.function.arguments) for t in c.message.tool_calls
        ]


def test_required_without_parallel_calls_makes_exactly_one(server):
    resp = server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=100, n=2, **SAMPLED,
    )
    for c in resp.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        assert_valid_calls(c.message, set(PARAMETERS))


def test_a_function_without_parameters_takes_any_json_object(server):
    tools = [{"type": "function", "function": {"name": "ping"}}]
    resp = server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=tools, tool_choice={"type": "function", "function": {"name": "ping"}},
        max_tokens=60, temperature=0.0,
    )
    [choice] = resp.choices
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "ping"
    assert isinstance(json.loads(choice.message.tool_calls[0].function.arguments), dict)


def test_a_call_cut_by_max_tokens_is_returned_as_content_with_finish_reason_length(server):
    resp = server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=4, temperature=0.0
    )
    [choice] = resp.choices
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content.startswith('{"')


def test_tool_choice_none_is_plain_generation(server):
    body = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})
    plain = server.client().chat.completions.create(**body)
    none = server.client().chat.completions.create(**body, tools=TOOLS, tool_choice="none")
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "length"


def test_a_conversation_with_tool_calls_and_tool_results_renders_and_continues(server):
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
        }]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ]
    resp = server.client().chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert resp.choices[0].finish_reason == "length"
    # The test template writes "role: content" per message, so the tool result is in the prompt.
    rendered = "<|bos|>user: the weather in Oslo?\n<|bos|>assistant: \n<|bos|>tool: rain\nassistant:"
    assert resp.usage.prompt_tokens == len(server.engine.tokenizer.encode(rendered, add_special_tokens=False))


def test_auto_with_a_template_that_shows_tools_is_served(make_server, tmp_path):
    path = tmp_path / "tools.jinja"
    path.write_text(TOOLS_TEMPLATE)
    live = make_server(chat_template=str(path))
    client = live.client()
    with_tools = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=8,
                                                temperature=0.0)
    without = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0.0)
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens  # the tools are in the prompt
    assert with_tools.choices[0].finish_reason in ("stop", "length", "tool_calls")


TOOL_ERRORS = [
    ({"tools": TOOLS}, "tool_choice"),  # auto, the default with tools, on a template that does not show them
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools.0"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}], "tool_choice": "required"}, "tools.0.type"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools.0.function"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "min_tokens": 1}, "min_tokens"),
]


@pytest.mark.parametrize(("body", "param"), TOOL_ERRORS, ids=[f"{p}-{i}" for i, (_, p) in enumerate(TOOL_ERRORS)])
def test_invalid_tools_or_tool_choice_are_a_400_naming_the_field(server, body, param):
    resp = server.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, **body})
    err = error_of(resp, 400)
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert_still_serving(server)


def test_auto_with_another_constraint_follows_the_constraint(server):
    resp = server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=20, temperature=0.0,
        extra_body={"guided_choice": ["sunny", "rainy"]},
    )
    [choice] = resp.choices
    assert choice.message.content in ("sunny", "rainy") and choice.message.tool_calls is None
