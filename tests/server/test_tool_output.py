"""server.tools.ToolOutput without a server: what streams out at once, what is held back, and which text
becomes tool calls (the "auto" format a random model never writes by itself)."""

from __future__ import annotations

import json

from server.tools import ToolMode, ToolOutput, ToolPlan, complete

AUTO = ToolPlan(ToolMode.AUTO, ("get_weather", "get_time"))
NAMED = ToolPlan(ToolMode.NAMED, ("get_weather",), "get_weather")
REQUIRED = ToolPlan(ToolMode.REQUIRED, ("get_weather", "get_time"))
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_auto_streams_text_until_a_tag_and_holds_the_call_to_the_end():
    out = ToolOutput(AUTO)
    assert out.feed("Let me check. <tool_") == "Let me check. "  # the tail could open a tag
    assert out.feed(CALL[len("<tool_"):]) == ""
    content, calls, finish = out.finish("stop")
    assert content == "" and finish == "tool_calls"
    [call] = calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    assert call.id.startswith("call_")


def test_a_held_tail_that_is_not_a_tag_goes_out_with_the_next_text():
    out = ToolOutput(AUTO)
    assert out.feed("a <") == "a "
    assert out.feed("b> c") == "<b> c"
    assert out.finish("stop") == ("", [], "stop")


def test_auto_keeps_the_text_around_calls_as_content_and_reads_several_calls():
    text = f"first {CALL} then {CALL.replace('get_weather', 'get_time')} done"
    content, calls, finish = complete(AUTO, text, "stop")
    assert content == "first  then  done" and [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert finish == "tool_calls"


def test_auto_leaves_unknown_names_broken_json_and_unclosed_tags_as_content():
    for text in (
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {}}',
    ):
        assert complete(AUTO, text, "stop") == (text, [], "stop")


def test_auto_takes_arguments_given_as_text_or_as_parameters():
    text = '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>'
    assert complete(AUTO, text, "stop")[1][0].function.arguments == '{"zone": "UTC"}'
    text = '<tool_call>{"name": "get_time", "parameters": {"zone": "UTC"}}</tool_call>'
    assert complete(AUTO, text, "stop")[1][0].function.arguments == '{"zone": "UTC"}'


def test_a_finish_by_length_stays_length_even_with_complete_calls():
    content, calls, finish = complete(AUTO, CALL + " and then", "length")
    assert len(calls) == 1 and content == "and then" and finish == "length"


def test_named_and_required_hold_everything_and_return_unparseable_text_as_content():
    for plan, text in ((NAMED, '{"city": "Os'), (REQUIRED, '[{"name": "get_time", "parameters": {')):
        out = ToolOutput(plan)
        assert out.feed(text) == ""
        assert out.finish("length") == (text, [], "length")


def test_named_arguments_are_the_generated_text_and_required_arguments_are_re_serialised():
    content, calls, finish = complete(NAMED, '{"city": "Oslo"}', "stop")
    assert content is None and finish == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}')]
    text = '[{"name": "get_time", "parameters": {"zone": "CET"}}, {"name": "get_weather", "parameters": {}}]'
    content, calls, finish = complete(REQUIRED, text, "stop")
    assert content is None and finish == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_time", '{"zone": "CET"}'),
                                                                        ("get_weather", "{}")]


def test_no_tools_passes_text_through_untouched():
    plan = ToolPlan(ToolMode.NONE)
    out = ToolOutput(plan)
    assert out.feed(CALL) == CALL and out.finish("stop") == ("", [], "stop")
    assert complete(plan, "", "stop") == ("", [], "stop")
