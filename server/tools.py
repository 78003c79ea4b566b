"""Chat tool calling: what a request's ``tool_choice`` asks of the output, and the tool calls in it.

- a named function: the output is constrained to that function's parameters schema and is its arguments;
- "required": the output is constrained to a JSON array of calls ``[{"name": ..., "parameters": {...}}]``
  (vLLM's format), at least one (exactly one with ``parallel_tool_calls: false``);
- "auto": unconstrained; ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (the
  Hermes/Qwen format) in the text become tool calls, the text around them stays content;
- "none": tools are only shown to the template.

A call is returned only when its JSON parses: an output cut by max_tokens (or by a stop string) is
returned as plain content with its own finish_reason, never as a call whose arguments cannot be read.
"finish_reason" becomes "tool_calls" where a generation that stopped by itself made at least one call.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass

from engine import Constraint
from server.errors import bad_request
from server.protocol import ChatCompletionRequest, Tool
from server.responses import DeltaToolCall, FunctionCall, ToolCall
from server.structured import ANY_OBJECT

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_TAGGED = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


class ToolMode(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolPlan:
    mode: ToolMode
    names: tuple[str, ...] = ()
    name: str | None = None  # the named function
    constraint: Constraint | None = None


def plan(req: ChatCompletionRequest) -> ToolPlan:
    """Validate ``tools`` and ``tool_choice`` (400s naming them) and decide what the output must be."""
    tools = req.tools or []
    names = tuple(t.function.name for t in tools)
    if len(set(names)) < len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise bad_request(f"tools has two functions named {dup!r}", "tools")
    choice = req.tool_choice
    if choice is None:
        return ToolPlan(ToolMode.AUTO if tools else ToolMode.NONE, names)
    if choice in ("none", "auto"):
        return ToolPlan(ToolMode(choice) if tools else ToolMode.NONE, names)
    if not tools:
        raise bad_request("tool_choice needs tools: name the functions the model may call", "tool_choice")
    if choice == "required":
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": [_call_schema(t) for t in tools]}}
        if req.parallel_tool_calls is False:
            calls["maxItems"] = 1
        strict = all(t.function.strict for t in tools)
        return ToolPlan(ToolMode.REQUIRED, names, constraint=Constraint.json_schema(calls, "tools", strict))
    name = choice.function.name
    if name not in names:
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})",
                          "tool_choice")
    i = names.index(name)
    fn = tools[i].function
    schema = ANY_OBJECT if fn.parameters is None else fn.parameters
    constraint = Constraint.json_schema(schema, f"tools.{i}.function.parameters", bool(fn.strict))
    return ToolPlan(ToolMode.NAMED, names, name, constraint)


def _call_schema(tool: Tool) -> dict:
    fn = tool.function
    parameters = ANY_OBJECT if fn.parameters is None else fn.parameters
    return {
        "type": "object",
        "properties": {"name": {"const": fn.name}, "parameters": parameters},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolOutput:
    """One choice's text on its way to the client: ``feed`` says what content can go out now, ``finish``
    what remains (content, tool calls, finish_reason). Not streamed: feed the whole text, then finish."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.held = ""
        self.in_call = False  # AUTO: an opening tag has been seen, so the rest is held to the end

    def feed(self, text: str) -> str:
        if self.plan.mode is ToolMode.NONE:
            return text
        self.held += text
        if self.plan.mode is not ToolMode.AUTO or self.in_call:
            return ""
        if OPEN in self.held:
            self.in_call = True
            i = self.held.index(OPEN)
            out, self.held = self.held[:i], self.held[i:]
            return out
        # Keep back a tail that could be the start of an opening tag.
        keep = next((k for k in range(min(len(OPEN) - 1, len(self.held)), 0, -1) if OPEN.startswith(self.held[-k:])), 0)
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return out

    def finish(self, finish_reason: str | None) -> tuple[str, list[ToolCall], str | None]:
        text, self.held = self.held, ""
        if self.plan.mode is ToolMode.NONE:
            return text, [], finish_reason
        calls, rest = self._calls(text)
        if not calls:
            return text, [], finish_reason
        return rest, calls, "tool_calls" if finish_reason == "stop" else finish_reason

    def _calls(self, text: str) -> tuple[list[ToolCall], str]:
        """The calls in ``text`` and the text left around them ([] where nothing parses)."""
        try:
            if self.plan.mode is ToolMode.NAMED:
                if isinstance(json.loads(text), dict):
                    return [_call(self.plan.name or "", text)], ""
            elif self.plan.mode is ToolMode.REQUIRED:
                calls = json.loads(text)
                return [_call(c["name"], _arguments(c["parameters"])) for c in calls], ""
        except (ValueError, TypeError, KeyError):
            pass
        if self.plan.mode is not ToolMode.AUTO:
            return [], text
        calls, kept, end = [], [], 0
        for m in _TAGGED.finditer(text):
            call = self._tagged(m.group(1))
            if call is not None:
                calls.append(call)
                kept.append(text[end : m.start()])
                end = m.end()
        kept.append(text[end:])
        rest = "".join(kept)
        return calls, rest if rest.strip() else ""  # no content made of the whitespace between calls

    def _tagged(self, body: str) -> ToolCall | None:
        """One ``{"name": ..., "arguments": {...}}`` block; None (left as content) unless it parses and
        names one of the request's tools."""
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self.plan.names:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            return _call(obj["name"], args)
        return _call(obj["name"], _arguments(args)) if isinstance(args, dict) else None


def complete(plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
    """A whole choice's content, tool calls and finish_reason (content None where only calls were made)."""
    out = ToolOutput(plan)
    sent = out.feed(text)
    rest, calls, finish = out.finish(finish_reason)
    content = sent + rest
    return (content.strip() or None) if calls else content, calls, finish


def _arguments(value: object) -> str:
    # The separators the engine's grammar writes JSON with (engine.types.constraint.JSON_FORMAT).
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=arguments))


def delta_calls(calls: list[ToolCall]) -> list[DeltaToolCall]:
    """The calls as one streamed delta each (OpenAI's ``delta.tool_calls[i]``)."""
    return [DeltaToolCall(index=i, id=c.id, function=c.function) for i, c in enumerate(calls)]
