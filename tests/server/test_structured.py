"""Structured output over HTTP: response_format (json_schema, json_object) and the guided_regex,
guided_choice and guided_grammar extensions, on both routes, streamed and not, with n > 1; and the 400s
naming the field for what cannot be compiled or combined, after which the server goes on serving."""

from __future__ import annotations

import json
import re

import jsonschema_rs
import pytest

from tests.server.conftest import MODEL
from tests.server.test_errors import error_of
from tests.server.test_validation import assert_still_serving

pytestmark = pytest.mark.timeout(120)

MESSAGES = [{"role": "user", "content": "the weather, please"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "rain": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["city", "days", "rain", "note"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
REGEX = r"[a-z]{3}-[0-9]{2}"
GRAMMAR = 'start: greeting " " name\ngreeting: "hello" | "hi"\nname: /[a-z]{2,5}/'
GRAMMAR_AS_REGEX = r"(hello|hi) [a-z]{2,5}"
SAMPLED = {"temperature": 1.0, "seed": 7}


def texts_of_stream(chunks) -> tuple[dict[int, str], dict[int, str]]:
    """Each choice's text and finish_reason, from chat or completion chunks."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return texts, finish


def test_json_schema_chat_responses_parse_and_validate_against_the_schema(server):
    resp = server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format=SCHEMA_FORMAT, max_tokens=80, n=3, **SAMPLED
    )
    assert [c.finish_reason for c in resp.choices] == ["stop"] * 3
    for c in resp.choices:
        jsonschema_rs.validate(WEATHER, json.loads(c.message.content))
        assert c.message.tool_calls is None
    # One fixed layout (engine.types.constraint.JSON_FORMAT): what json.dumps writes.
    assert all(c.message.content == json.dumps(json.loads(c.message.content), ensure_ascii=False) for c in resp.choices)


def test_streamed_json_schema_completion_equals_the_same_request_not_streamed(server):
    body = dict(model=MODEL, prompt="def fib(n):", max_tokens=80, n=2, **SAMPLED,
                extra_body={"response_format": SCHEMA_FORMAT})
    client = server.client()
    plain = client.completions.create(**body)
    texts, finish = texts_of_stream(client.completions.create(**body, stream=True))
    assert texts == {c.index: c.text for c in plain.choices}
    assert finish == {0: "stop", 1: "stop"}
    for text in texts.values():
        jsonschema_rs.validate(WEATHER, json.loads(text))


def test_json_object_and_a_schemaless_json_schema_give_json_objects(server):
    client = server.client()
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "any"}}):
        resp = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, response_format=fmt, max_tokens=60, temperature=0.0
        )
        [choice] = resp.choices
        assert choice.finish_reason == "stop", choice
        assert isinstance(json.loads(choice.message.content), dict)


def test_guided_choice_returns_one_of_the_choices_on_both_routes(server):
    options = ["yes", "no", "maybe later"]
    client = server.client()
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, n=4, **SAMPLED, extra_body={"guided_choice": options}
    )
    comp = client.completions.create(
        model=MODEL, prompt=["a", "b"], max_tokens=24, **SAMPLED, extra_body={"guided_choice": options}
    )
    outputs = [c.message.content for c in chat.choices] + [c.text for c in comp.choices]
    assert len(outputs) == 6 and all(text in options for text in outputs), outputs
    assert {c.finish_reason for c in chat.choices + comp.choices} == {"stop"}


def test_guided_regex_output_fullmatches_the_regex_streamed_and_not(server):
    client = server.client()
    body = dict(model=MODEL, messages=MESSAGES, max_tokens=20, n=2, **SAMPLED, extra_body={"guided_regex": REGEX})
    plain = client.chat.completions.create(**body)
    texts, finish = texts_of_stream(client.chat.completions.create(**body, stream=True))
    assert texts == {c.index: c.message.content for c in plain.choices}
    assert finish == {0: "stop", 1: "stop"}
    assert all(re.fullmatch(REGEX, text) for text in texts.values()), texts


def test_a_lark_grammar_constrains_the_output(server):
    resp = server.client().completions.create(
        model=MODEL, prompt="say hello:", max_tokens=20, n=3, **SAMPLED, extra_body={"guided_grammar": GRAMMAR}
    )
    for c in resp.choices:
        assert c.finish_reason == "stop" and re.fullmatch(GRAMMAR_AS_REGEX, c.text), c


def test_a_text_response_format_is_plain_generation(server):
    body = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})
    plain = server.client().chat.completions.create(**body)
    text = server.client().chat.completions.create(**body, response_format={"type": "text"})
    assert text.choices[0].message.content == plain.choices[0].message.content


def bad_schema(schema: object) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


ERROR_CASES = [
    (bad_schema({"type": "foo"}), "response_format.json_schema.schema"),
    (bad_schema({"anyOf": []}), "response_format.json_schema.schema"),
    (bad_schema("an object"), "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "(a"}, "guided_regex"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_grammar": "start: foo bar"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", ""]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"guided_choice": ["a"], "guided_grammar": GRAMMAR}, "guided_grammar"),
    ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens"),
]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("body", "param"), ERROR_CASES, ids=[f"{p}-{i}" for i, (_, p) in enumerate(ERROR_CASES)])
def test_what_cannot_be_compiled_or_combined_is_a_400_naming_the_field(server, route, body, param):
    prompt = {"prompt": "x"} if route == "/v1/completions" else {"messages": MESSAGES}
    err = error_of(server.post(route, {"model": MODEL, **prompt, "max_tokens": 8, **body}), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert "Traceback" not in err["message"]
    assert_still_serving(server)
