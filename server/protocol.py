"""OpenAI request schemas (pydantic), field for field, plus a few marked extensions; the responses are
in server.responses.

Unknown request fields are ignored, as OpenAI-compatible servers commonly do; fields whose
meaning we cannot honour (suffix, best_of other than n) are rejected in the routes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    name: str = Field(max_length=64)  # required by OpenAI; unused here
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # OpenAI's default is False: unsupported schema keywords are then ignored


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None  # required with type json_schema (server.structured)


class SamplingFields(BaseModel):
    """Fields shared by both endpoints. The ranges here are OpenAI's, so the OpenAPI schema documents them;
    SamplingParams checks them again for the engine, and Serving.check_request checks the server's own limits."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1)  # at most --max-n (Serving.check_request)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extensions (vLLM names where vLLM has them).
    top_k: int | None = Field(None, ge=0)  # 0: no top-k
    min_p: float | None = Field(None, ge=0, le=1)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    num_speculative_tokens: int | None = Field(None, ge=0, le=16)  # 0 turns speculation off for this request
    # vLLM's: each prompt token's logprob under the target (the first has none) and its top-N, per choice.
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    return_token_ids: bool = False  # add prompt_token_ids and token_ids to each choice
    # Structured output (server.structured): at most one of these per request.
    response_format: ResponseFormat | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # Lark, as llguidance reads it
    # Back off the prompt's last token and let the model re-spell it (engine.structured.healing); None: the
    # server's default (--token-healing), which requests with structured output never take.
    token_healing: bool | None = None

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # OpenAI and vLLM refuse it too: without a stream there is nothing for the options to shape.
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @property
    def include_usage(self) -> bool:
        """A streamed request's last chunk carries the usage."""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo: the prompt scored, nothing generated
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, name, ...: passed through to the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; None: any JSON object
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool | None = None  # False: tool_choice "required" makes exactly one call
