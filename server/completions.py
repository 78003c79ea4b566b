"""POST /v1/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from server import sse, structured
from server.async_engine import EngineRequest, RequestHandle
from server.errors import bad_request, from_exception
from server.logprobs import TextOffsets, completion_logprobs
from server.protocol import CompletionChoice, CompletionChunk, CompletionRequest, CompletionResponse
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


def _prompts(prompt: str | list) -> list[str | list[int]]:
    """string | list[str] | list[int] | list[list[int]] -> a list of prompts."""
    prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
    # Checked here, whatever the tokenizer would make of it (one that adds BOS turns "" into a token).
    if not prompts or any(len(p) == 0 for p in prompts):
        raise bad_request("prompt must not be empty (nor hold an empty string or token list)", param="prompt")
    return prompts


async def create_completion(req: CompletionRequest, raw: Request, ctx: Serving) -> Response:
    arrival = time.monotonic()
    ctx.check_model(req.model)
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is not supported (it must equal n when given)", param="best_of")
    prompts = _prompts(req.prompt)
    ctx.check_request(req, len(prompts))
    constraint = structured.only_one(structured.requested(req))
    rid = new_id("cmpl")
    n = req.n
    requests, choices, prompt_ids = [], {}, []
    for p, prompt in enumerate(prompts):
        params = sampling_params(
            req, ctx.provisional_max(req.max_tokens), req.logprobs, ctx.engine.vocab_size, constraint,
            ctx.limits.token_healing,
        )
        ids, params = ctx.prepare(prompt, params, req.max_tokens, "prompt")
        prompt_ids.append(ids)
        for i in range(n):
            index = p * n + i
            engine_id = f"{rid}-{index}"
            requests.append(EngineRequest(engine_id, ids, choice_params(params, i)))
            choices[engine_id] = Choice(engine_id, ids, index=index)
    echo = [p if isinstance(p, str) else _decode(ctx, i) for p, i in zip(prompts, prompt_ids)] if req.echo else None
    num_prompt_tokens = sum(len(i) for i in prompt_ids)
    handle = ctx.submit(requests, RequestInfo(rid, arrival, num_prompt_tokens, lambda: str(req.prompt)))
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = _stream(req, ctx, rid, handle, choices, echo, n, num_prompt_tokens, include_usage)
        return sse.response(events, handle.close)
    await until_disconnect(raw, collect(handle, choices))
    ordered = sorted(choices.values(), key=lambda c: c.index)
    out = []
    for c in ordered:
        text, logprobs = c.text, None
        prompt_echo = echo[c.index // n] if echo else None
        if req.logprobs is not None:
            logprobs = completion_logprobs(ctx.text, c.logprobs, TextOffsets(), c.prompt_token_ids if echo else None)
        if prompt_echo is not None:
            text = prompt_echo + text
        out.append(_choice(req, c, text, logprobs, c.finish_reason))
    body = CompletionResponse(id=rid, model=ctx.model_name, choices=out, usage=usage(ordered, num_prompt_tokens, n))
    return JSONResponse(body.model_dump(mode="json"))


def _decode(ctx: Serving, ids: list[int]) -> str:
    tok = ctx.engine.tokenizer
    return tok.decode(ids) if tok is not None else ""


def _choice(req: CompletionRequest, c: Choice, text: str, logprobs: object, finish: str | None) -> CompletionChoice:
    extra = {}
    if req.return_token_ids:
        extra = {"prompt_token_ids": c.prompt_token_ids, "token_ids": c.token_ids}
    return CompletionChoice(
        index=c.index, text=text, logprobs=logprobs, finish_reason=finish,
        stop_reason=c.stop_reason if finish else None, **extra,
    )


async def _stream(
    req: CompletionRequest,
    ctx: Serving,
    rid: str,
    handle: RequestHandle,
    choices: dict[str, Choice],
    echo: Sequence[str] | None,
    n: int,
    num_prompt_tokens: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    created = int(time.time())
    offsets = {c.index: TextOffsets() for c in choices.values()}
    try:
        async for out in handle.outputs():
            c = choices[out.request_id]
            c.add(out)
            text, prompt_ids = out.new_text, None
            if not c.started:
                c.started = True
                if echo is not None:
                    text = echo[c.index // n] + text
                    prompt_ids = c.prompt_token_ids
            ids_wanted = req.return_token_ids and out.new_token_ids
            if not (text or out.finished or (req.logprobs is not None and out.new_logprobs) or ids_wanted):
                continue  # a token whose text is held back (part of a character or of a stop string)
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(ctx.text, out.new_logprobs, offsets[c.index], prompt_ids)
            choice = _choice(req, c, text, logprobs, out.finish_reason if out.finished else None)
            if req.return_token_ids:
                choice.prompt_token_ids = prompt_ids
                choice.token_ids = list(out.new_token_ids)
            yield sse.event(CompletionChunk(id=rid, created=created, model=ctx.model_name, choices=[choice]))
        if include_usage:
            final = usage(list(choices.values()), num_prompt_tokens, n)
            yield sse.event(CompletionChunk(id=rid, created=created, model=ctx.model_name, choices=[], usage=final))
    except Exception as exc:  # the status line is sent: report in-band (cancellation is not an Exception)
        yield sse.error_event(from_exception(exc))
    yield sse.DONE
