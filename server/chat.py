"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template; tools (server.tools).
``create_chat_completion`` is the whole path, top to bottom; the helpers below it come in the order it
calls them."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine import Constraint, check_text
from server import structured, tools
from server.errors import bad_request
from server.generation import Choice, Generation
from server.logprobs import chat_logprobs, vllm_prompt_logprobs
from server.protocol import ChatCompletionRequest
from server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    Delta,
)
from server.serving import Serving
from server.tools import ToolMode, ToolPlan

logger = logging.getLogger(__name__)


async def create_chat_completion(req: ChatCompletionRequest, raw: Request, ctx: Serving) -> Response:
    """parse -> validate -> submit -> stream or collect -> respond."""
    arrival = time.monotonic()
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    tool_plan, constraint = _validate(req, ctx)
    prompt = render(req, ctx, tool_plan)
    params = ctx.sampling_params(req, max_tokens, logprobs, constraint, req.prompt_logprobs)
    prepared = ctx.prepare(prompt, params, max_tokens, "messages")  # no max: OpenAI's default, the rest
    gen = ctx.submit("chatcmpl", arrival, [prepared], req.n, lambda: _messages_text(req))
    if req.stream:
        return gen.stream(_chunks(req, ctx, gen, tool_plan))
    choices = await gen.collect(raw)
    return JSONResponse(_response(req, ctx, gen, choices, tool_plan).model_dump(mode="json"))


def _validate(req: ChatCompletionRequest, ctx: Serving) -> tuple[ToolPlan, Constraint | None]:
    """What needs no template: the model, tools and output constraints, logprobs, the server's limits."""
    ctx.check_model(req.model)
    tool_plan, constraint = _output_plan(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    ctx.check_request(req)
    return tool_plan, constraint


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


def render(req: ChatCompletionRequest, ctx: Serving, plan: ToolPlan, generation_prompt: bool = True,
           special_tokens: bool = False) -> list[int]:
    """The prompt's token ids. The template already writes any BOS it wants, so no special tokens are added
    (unless ``special_tokens``, /tokenize's add_special_tokens). Tools go to the template whatever tool_choice
    says; "auto" needs a template that shows them."""
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
    text = _apply_template(tok, template, messages, shown, generation_prompt)
    if plan.mode is ToolMode.AUTO and (
        not all(name in text for name in plan.names)
        or text == _apply_template(tok, template, messages, None, generation_prompt)
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
    return tok.encode(text, add_special_tokens=special_tokens)


def prompt_of(req: ChatCompletionRequest, ctx: Serving, generation_prompt: bool, special_tokens: bool) -> list[int]:
    """The token ids a chat request's messages (and tools) render to, as create_chat_completion would feed them."""
    plan, _ = _validate(req, ctx)
    return render(req, ctx, plan, generation_prompt, special_tokens)


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


def _apply_template(tok: object, template: str, messages: list[dict], tools: list[dict] | None,
                    generation_prompt: bool = True) -> str:
    try:
        return tok.apply_chat_template(
            messages, tools=tools, chat_template=template, add_generation_prompt=generation_prompt, tokenize=False
        )
    except Exception as exc:
        if type(exc).__module__.startswith("jinja2"):  # e.g. raise_exception in the template: it describes the messages
            raise bad_request(f"the chat template rejected the messages: {exc}", param="messages") from None
        # Anything else the template tripped over (a TypeError on an odd field) is still about these messages.
        logger.info("the chat template failed on a request's messages: %s", type(exc).__name__)
        raise bad_request("the chat template could not render these messages", param="messages") from None


async def _chunks(
    req: ChatCompletionRequest, ctx: Serving, gen: Generation, tool_plan: ToolPlan
) -> AsyncIterator[ChatCompletionChunk]:
    created = int(time.time())

    def chunk(choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=gen.id, created=created, model=ctx.model_name, choices=[choice])

    # OpenAI opens every choice with an empty assistant delta.
    for c in gen.ordered():
        yield chunk(ChatChunkChoice(index=c.index, delta=Delta(role="assistant", content="")))
    held = {engine_id: tools.ToolOutput(tool_plan) for engine_id in gen.choices}
    async for c, out in gen.outputs():
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
    if req.include_usage:
        yield ChatCompletionChunk(id=gen.id, created=created, model=ctx.model_name, choices=[], usage=gen.usage())


def _response(
    req: ChatCompletionRequest, ctx: Serving, gen: Generation, choices: list[Choice], tool_plan: ToolPlan
) -> ChatCompletionResponse:
    out = []
    for c in choices:
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
    prompt = None  # one prompt for every choice: vLLM puts its logprobs on the response
    if req.prompt_logprobs is not None and choices and choices[0].prompt_logprobs is not None:
        prompt = vllm_prompt_logprobs(ctx.text, choices[0].prompt_token_ids, choices[0].prompt_logprobs)
    return ChatCompletionResponse(id=gen.id, model=ctx.model_name, choices=out, usage=gen.usage(),
                                  prompt_logprobs=prompt)


def _messages_text(req: ChatCompletionRequest) -> str:
    return json.dumps([m.model_dump(exclude_none=True) for m in req.messages])
