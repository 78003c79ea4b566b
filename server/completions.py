"""POST /v1/completions. ``create_completion`` is the whole path, top to bottom; the helpers below it
come in the order it calls them."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from server import structured
from server.errors import bad_request
from server.generation import Choice, Generation
from server.logprobs import TextOffsets, completion_logprobs, vllm_prompt_logprobs
from server.protocol import CompletionRequest
from server.responses import CompletionChoice, CompletionChunk, CompletionResponse
from server.serving import Serving


async def create_completion(req: CompletionRequest, raw: Request, ctx: Serving) -> Response:
    """parse -> validate -> submit -> stream or collect -> respond."""
    arrival = time.monotonic()
    prompts = _prompts(req.prompt)
    _validate(req, prompts, ctx)
    constraint = structured.only_one(structured.requested(req))
    params = ctx.sampling_params(req, req.max_tokens, req.logprobs, constraint, _prompt_logprobs(req))
    prepared = [ctx.prepare(prompt, params, req.max_tokens, "prompt") for prompt in prompts]
    echo = [_echo(ctx, prompt, ids) for prompt, (ids, _) in zip(prompts, prepared)] if req.echo else None
    gen = ctx.submit("cmpl", arrival, prepared, req.n, lambda: str(req.prompt))
    if req.stream:
        return gen.stream(_chunks(req, ctx, gen, echo))
    choices = await gen.collect(raw)
    return JSONResponse(_response(req, ctx, gen, choices, echo).model_dump(mode="json"))


def _prompt_logprobs(req: CompletionRequest) -> int | None:
    """What the engine must score of the prompt: echo with logprobs shows the prompt's own (OpenAI's format), and
    vLLM's prompt_logprobs asks for them outright; the larger top-N serves both."""
    wanted = [n for n in (req.logprobs if req.echo else None, req.prompt_logprobs) if n is not None]
    return max(wanted) if wanted else None


def _prompts(prompt: str | list) -> list[str | list[int]]:
    """string | list[str] | list[int] | list[list[int]] -> a list of prompts."""
    return [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)


def _validate(req: CompletionRequest, prompts: Sequence[str | list[int]], ctx: Serving) -> None:
    """What needs no tokenizer: the model, the fields we cannot honour, empty prompts, the server's limits."""
    ctx.check_model(req.model)
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens must be >= 1 unless echo is true (max_tokens 0 with echo scores the prompt)",
                          param="max_tokens")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is not supported (it must equal n when given)", param="best_of")
    # Checked here, whatever the tokenizer would make of it (one that adds BOS turns "" into a token).
    if not prompts or any(len(p) == 0 for p in prompts):
        raise bad_request("prompt must not be empty (nor hold an empty string or token list)", param="prompt")
    ctx.check_request(req, len(prompts))


def _echo(ctx: Serving, prompt: str | list[int], ids: list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    tok = ctx.engine.tokenizer
    return tok.decode(ids) if tok is not None else ""


async def _chunks(
    req: CompletionRequest, ctx: Serving, gen: Generation, echo: Sequence[str] | None
) -> AsyncIterator[CompletionChunk]:
    created = int(time.time())
    offsets = {c.index: TextOffsets() for c in gen.choices.values()}
    async for c, out in gen.outputs():
        text, prompt_ids, prompt_scores = out.new_text, None, None
        if not c.started:
            c.started = True
            if echo is not None:
                text = echo[c.index // gen.n] + text
                prompt_ids, prompt_scores = c.prompt_token_ids, out.prompt_logprobs
        ids_wanted = req.return_token_ids and out.new_token_ids
        if not (text or out.finished or (req.logprobs is not None and out.new_logprobs) or ids_wanted):
            continue  # a token whose text is held back (part of a character or of a stop string)
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs(ctx.text, out.new_logprobs, offsets[c.index], prompt_ids, prompt_scores)
        choice = _choice(req, c, text, logprobs, out.finish_reason if out.finished else None)
        if req.prompt_logprobs is not None and out.prompt_logprobs is not None:
            choice.prompt_logprobs = vllm_prompt_logprobs(ctx.text, c.prompt_token_ids, out.prompt_logprobs)
        if req.return_token_ids:
            choice.prompt_token_ids = prompt_ids
            choice.token_ids = list(out.new_token_ids)
        yield CompletionChunk(id=gen.id, created=created, model=ctx.model_name, choices=[choice])
    if req.include_usage:
        yield CompletionChunk(id=gen.id, created=created, model=ctx.model_name, choices=[], usage=gen.usage())


def _response(
    req: CompletionRequest, ctx: Serving, gen: Generation, choices: list[Choice], echo: Sequence[str] | None
) -> CompletionResponse:
    out = []
    for c in choices:
        text, logprobs = c.text, None
        prompt_echo = echo[c.index // gen.n] if echo else None
        if req.logprobs is not None:
            logprobs = completion_logprobs(ctx.text, c.logprobs, TextOffsets(), c.prompt_token_ids if echo else None,
                                           c.prompt_logprobs if echo else None)
        if prompt_echo is not None:
            text = prompt_echo + text
        choice = _choice(req, c, text, logprobs, c.finish_reason)
        if req.prompt_logprobs is not None and c.prompt_logprobs is not None:
            choice.prompt_logprobs = vllm_prompt_logprobs(ctx.text, c.prompt_token_ids, c.prompt_logprobs)
        out.append(choice)
    return CompletionResponse(id=gen.id, model=ctx.model_name, choices=out, usage=gen.usage())


def _choice(req: CompletionRequest, c: Choice, text: str, logprobs: object, finish: str | None) -> CompletionChoice:
    extra = {}
    if req.return_token_ids:
        extra = {"prompt_token_ids": c.prompt_token_ids, "token_ids": c.token_ids}
    return CompletionChoice(
        index=c.index, text=text, logprobs=logprobs, finish_reason=finish,
        stop_reason=c.stop_reason if finish else None, **extra,
    )
