"""POST /tokenize and /detokenize, GET /tokenizer_info: vLLM's routes, with its request and response shapes.

Evaluation harnesses call them to count and split text the way the served model does (lm-evaluation-harness
probes /tokenizer_info to learn the tokenizer), so the ids are exactly the ones generation would feed.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field

from server.chat import prompt_of
from server.errors import APIError, bad_request, from_exception
from server.protocol import ChatCompletionRequest, ChatMessage, Tool
from server.routes.deps import State
from server.serving import Serving
from server.state import AppState

router = APIRouter()


class TokenizeRequest(BaseModel):
    """A prompt, or chat messages rendered by the chat template, as vLLM takes either."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True  # messages only
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages (the template writes BOS)
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int] = Field(min_length=1)


class DetokenizeResponse(BaseModel):
    prompt: str


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: State) -> TokenizeResponse:
    ctx, tok = _ready(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", param="prompt")
    try:
        if body.prompt is not None:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        else:
            chat = ChatCompletionRequest(model=body.model, messages=body.messages, tools=body.tools)
            ids = prompt_of(chat, ctx, body.add_generation_prompt, body.add_special_tokens is True)
    except Exception as exc:  # a template that fails on these messages, say: a 400 naming them
        raise from_exception(exc) from None
    strs = [ctx.text.text(t) for t in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: State) -> DetokenizeResponse:
    ctx, tok = _ready(state, body.model)
    vocab = ctx.engine.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise bad_request(f"tokens must be ids in [0, {vocab})", param="tokens")
    return DetokenizeResponse(prompt=tok.decode(body.tokens))


@router.get("/tokenizer_info")
async def tokenizer_info(state: State) -> dict[str, Any]:
    ctx, tok = _ready(state, None)
    special = {name: getattr(tok, name, None) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    return {
        "tokenizer_class": type(tok).__name__, "vocab_size": len(tok), "model_max_length": ctx.max_model_len,
        "max_model_len": ctx.max_model_len, "chat_template": ctx.chat_template or getattr(tok, "chat_template", None),
        **{k: v if isinstance(v, str) or v is None else str(v) for k, v in special.items()},
    }


def _ready(state: AppState, model: str | None) -> tuple[Serving, Any]:
    """The serving context and its tokenizer, for a request naming ``model`` (or none)."""
    ctx = state.require_serving()
    ctx.check_model(model)
    tok = ctx.engine.tokenizer
    if tok is None:
        raise APIError(404, "this model was served without a tokenizer: only token ids work", code="no_tokenizer")
    return ctx, tok
