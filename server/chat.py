"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template; tools (server.tools)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine import Constraint, check_text
from server import sse, structured, tools
from server.async_engine import EngineRequest, RequestHandle
from server.errors import bad_request, from_exception
from server.logprobs import chat_logprobs
from server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    Delta,
)
from server.request_stats import RequestInfo
from server.serving import (
    Choice,
    Serving,
    choice_params,
    collect,
    new_id,
    sampling_params,
    until_disconnect,
    usage,
)
from server.tools import ToolMode, ToolPlan

logger = logging.getLogger(__name__)


def render(req: ChatCompletionRequest, ctx: Serving, plan: ToolPlan) -> list[int]:
    """The prompt's token ids. The template already writes any BOS it wants, so no special tokens are added.
    Tools go to the template whatever tool_choice says; "auto" needs a template that shows them."""
    tok = ctx.engine.tokenizer
    template = ctx.chat_template or (getattr(tok, "chat_template", None) if tok is not None else None)
    if tok is None or not template:
        raise bad_request(
            "this model's tokenizer has no chat template, so chat messages cannot be rendered; "
            "use /v1/completions, or start the server with --chat-template FILE",
            param="messages", code="chat_template_missing",
        )
    messages = _messages(req)
    shown = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    text = _apply_template(tok, template, messages, shown)
    if plan.mode is ToolMode.AUTO and (
        not all(name in text for name in plan.names) or text == _apply_template(tok, template, messages, None)
    ):
        raise bad_request(
            "this model's chat template does not show tools to the model, so it cannot decide to call one "
            '(tool_choice "auto", the default with tools); use tool_choice "required" or name a function',
            param="tool_choice",
        )
    try:
        check_text(text)
    except ValueError as exc:
        raise bad_request(f"messages: {exc}", param="messages", code="invalid_prompt") from None
    return tok.encode(text, add_special_tokens=False)


def _messages(req: ChatCompletionRequest) -> list[dict]:
    messages = []
    for i, m in enumerate(req.messages):
        msg = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            if any(part.type != "text" for part in m.content):
                raise bad_request("only text content parts are supported", param=f"messages.{i}.content")
            msg["content"] = "".join(part.text or "" for part in m.content)
        if isinstance(msg.get("tool_calls"), list):
            msg["tool_calls"] = [_parsed_arguments(call) for call in msg["tool_calls"]]
        messages.append(msg)
    return messages


def _parsed_arguments(call: object) -> object:
    """OpenAI sends a call's arguments as JSON text; templates (Qwen's, Llama's) write them as an object."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}} if isinstance(args, dict) else call


def _apply_template(tok: object, template: str, messages: list[dict], tools: list[dict] | None) -> str:
    try:
        return tok.apply_chat_template(
            messages, tools=tools, chat_template=template, add_generation_prompt=True, tokenize=False
        )
    except Exception as exc:
        if type(exc).__module__.startswith("jinja2"):  # e.g. raise_exception in the template: it describes the messages
            raise bad_request(f"the chat template rejected the messages: {exc}", param="messages") from None
        # Anything else the template tripped over (a TypeError on an odd field) is still about these messages.
        logger.info("the chat template failed on a request's messages: %s", type(exc).__name__)
        raise bad_request("the chat template could not render these messages", param="messages") from None


def _messages_text(req: ChatCompletionRequest) -> str:
    return json.dumps([m.model_dump(exclude_none=True) for m in req.messages])


async def create_chat_completion(req: ChatCompletionRequest, raw: Request, ctx: Serving) -> Response:
    arrival = time.monotonic()
    ctx.check_model(req.model)
    tool_plan, constraint = _output_plan(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    ctx.check_request(req)
    prompt = render(req, ctx, tool_plan)
    params = sampling_params(req, ctx.provisional_max(max_tokens), logprobs, ctx.engine.vocab_size, constraint,
                             ctx.limits.token_healing)
    ids, params = ctx.prepare(prompt, params, max_tokens, "messages")  # no max: OpenAI's default, the rest
    rid = new_id("chatcmpl")
    requests, choices = [], {}
    for i in range(req.n):
        engine_id = f"{rid}-{i}"
        requests.append(EngineRequest(engine_id, ids, choice_params(params, i)))
        choices[engine_id] = Choice(engine_id, ids, index=i)
    handle = ctx.submit(requests, RequestInfo(rid, arrival, len(ids), lambda: _messages_text(req)))
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = _stream(req, ctx, rid, handle, choices, tool_plan, len(ids), include_usage)
        return sse.response(events, handle.close)
    await until_disconnect(raw, collect(handle, choices))
    out = []
    ordered = sorted(choices.values(), key=lambda c: c.index)
    for c in ordered:
        extra = {"prompt_token_ids": c.prompt_token_ids, "token_ids": c.token_ids} if req.return_token_ids else {}
        content, calls, finish = tools.complete(tool_plan, c.text, c.finish_reason)
        out.append(
            ChatChoice(
                index=c.index,
                message=AssistantMessage(content=content, tool_calls=calls or None),
                logprobs=chat_logprobs(ctx.text, c.logprobs) if req.logprobs else None,
                finish_reason=finish,
                stop_reason=c.stop_reason,
                **extra,
            )
        )
    body = ChatCompletionResponse(id=rid, model=ctx.model_name, choices=out, usage=usage(ordered, len(ids), req.n))
    return JSONResponse(body.model_dump(mode="json"))


def _output_plan(req: ChatCompletionRequest) -> tuple[ToolPlan, Constraint | None]:
    """What the tools ask for and the request's one output constraint. With "auto", another constraint
    wins: the output then follows it and is never read for tool calls."""
    tool_plan = tools.plan(req)
    found = structured.requested(req)
    if tool_plan.constraint is not None:
        found.append(("tool_choice", tool_plan.constraint))
    elif tool_plan.mode is ToolMode.AUTO and found:
        tool_plan = ToolPlan(ToolMode.NONE, tool_plan.names)
    return tool_plan, structured.only_one(found)


async def _stream(
    req: ChatCompletionRequest,
    ctx: Serving,
    rid: str,
    handle: RequestHandle,
    choices: dict[str, Choice],
    tool_plan: ToolPlan,
    num_prompt_tokens: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choice: ChatChunkChoice) -> str:
        return sse.event(ChatCompletionChunk(id=rid, created=created, model=ctx.model_name, choices=[choice]))

    try:
        # OpenAI opens every choice with an empty assistant delta.
        for c in sorted(choices.values(), key=lambda c: c.index):
            yield chunk(ChatChunkChoice(index=c.index, delta=Delta(role="assistant", content="")))
        held = {engine_id: tools.ToolOutput(tool_plan) for engine_id in choices}
        async for out in handle.outputs():
            c = choices[out.request_id]
            c.add(out)
            text, calls, finish = held[out.request_id].feed(out.new_text), [], None
            if out.finished:
                rest, calls, finish = held[out.request_id].finish(out.finish_reason)
                text += rest
            has_logprobs = req.logprobs and out.new_logprobs
            ids_wanted = req.return_token_ids and out.new_token_ids
            if not (text or out.finished or has_logprobs or ids_wanted):
                continue  # text held back (part of a character, of a stop string, or of a tool call)
            yield chunk(
                ChatChunkChoice(
                    index=c.index,
                    delta=Delta(content=text or None, tool_calls=tools.delta_calls(calls) or None),
                    logprobs=chat_logprobs(ctx.text, out.new_logprobs) if req.logprobs else None,
                    finish_reason=None if calls else finish,
                    token_ids=list(out.new_token_ids) if req.return_token_ids else None,
                )
            )
            if calls:  # as OpenAI ends a choice that called tools: an empty delta with the finish_reason
                yield chunk(ChatChunkChoice(index=c.index, delta=Delta(), finish_reason=finish))
        if include_usage:
            final = usage(list(choices.values()), num_prompt_tokens, req.n)
            chunk_ = ChatCompletionChunk(id=rid, created=created, model=ctx.model_name, choices=[], usage=final)
            yield sse.event(chunk_)
    except Exception as exc:  # the status line is sent: report in-band (cancellation is not an Exception)
        yield sse.error_event(from_exception(exc))
    yield sse.DONE
