"""OpenAI response schemas (pydantic), field for field, plus a few marked extensions; the requests are
in server.protocol."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field


def _none(v: object) -> bool:
    return v is None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


class SpecMethodUsage(BaseModel):
    draft_tokens: int = 0
    accepted_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    # Extensions: this request's speculative decoding (all choices), and the same split by the method that
    # drafted (left out when nothing was drafted).
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_by_method: dict[str, SpecMethodUsage] | None = Field(None, exclude_if=_none)


class CompletionLogprobs(BaseModel):
    """The legacy completions format. With echo the prompt's tokens come first, the very first with null."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry, keyed by token id (as a string in JSON)."""

    logprob: float
    rank: int | None = None
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = Field(None, exclude_if=_none)
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_none)
    token_ids: list[int] | None = Field(None, exclude_if=_none)
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(None, exclude_if=_none)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None = None
    refusal: list[TokenLogprobEntry] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=_none)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = Field(None, exclude_if=_none)
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_none)
    token_ids: list[int] | None = Field(None, exclude_if=_none)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(None, exclude_if=_none)  # vLLM's


class DeltaToolCall(BaseModel):
    """A whole tool call in one streamed delta (OpenAI may split ``arguments`` over several)."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Delta(BaseModel):
    role: Literal["assistant"] | None = Field(None, exclude_if=_none)
    content: str | None = Field(None, exclude_if=_none)
    tool_calls: list[DeltaToolCall] | None = Field(None, exclude_if=_none)


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(None, exclude_if=_none)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, exclude_if=_none)
    system_fingerprint: str | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, exclude_if=_none)
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "specd"
    root: str
    parent: str | None = None
    max_model_len: int
    # Extensions: how this model is served.
    draft_model: str | None = None
    speculative_method: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
