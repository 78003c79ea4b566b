"""What both generation endpoints share: validation, sampling parameters, submission, per-choice
state, usage, and aborting when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request

from engine import CompletionOutput, Constraint, LLMEngine, SamplingParamError, SamplingParams
from server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineRequest,
    NotAcceptingError,
    QueueFullError,
    RequestHandle,
)
from server.errors import APIError, bad_request, unavailable
from server.logprobs import TokenText
from server.protocol import PromptTokensDetails, SamplingFields, SpecMethodUsage, Usage
from server.request_stats import RequestInfo, RequestTracking

T = TypeVar("T")
RETRY_AFTER_S = 1
# Limits of our own, past the configurable ones: each bounds the per-token or per-step work one request can ask for.
MAX_STOP_CHARS = 256  # per stop string: held-back text is rescanned for it after every token
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300  # entries, applied in Python to every row of every step


@dataclass(frozen=True)
class Limits:
    """Per-request limits and defaults from the server's options (--max-n, --max-stop-sequences,
    --request-timeout, --token-healing)."""

    max_n: int = 128
    max_stop_sequences: int = 4
    request_timeout: float | None = None  # seconds; None: no deadline
    token_healing: bool = False  # for requests that leave token_healing unset


class ClientGoneError(Exception):
    """The client disconnected before the response was ready."""


@dataclass(frozen=True)
class Serving:
    """Everything a request handler needs, available once the engine has loaded."""

    engine: LLMEngine  # only prepare() and read-only attributes are used from the event loop
    async_engine: AsyncEngine
    model_name: str
    text: TokenText
    chat_template: str | None
    tracking: RequestTracking | None = None  # metrics and request logs; None in bare tests
    limits: Limits = Limits()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise APIError(
                404, f"the model {requested!r} does not exist; this server serves {self.model_name!r}",
                type="not_found_error", param="model", code="model_not_found",
            )

    def check_request(self, req: SamplingFields, num_prompts: int = 1) -> None:
        """The limits a field's own type cannot express: the server's options and our own bounds."""
        limits = self.limits
        if req.n > limits.max_n:
            raise bad_request(f"n must be at most {limits.max_n} on this server (--max-n), got {req.n}", param="n")
        stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
        if len(stops) > limits.max_stop_sequences:
            raise bad_request(
                f"at most {limits.max_stop_sequences} stop sequences are allowed (--max-stop-sequences), "
                f"got {len(stops)}", param="stop",
            )
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise bad_request(f"each stop sequence must be at most {MAX_STOP_CHARS} characters", param="stop")
        if len(req.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
            raise bad_request(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed", param="stop_token_ids")
        if len(req.logit_bias or {}) > MAX_LOGIT_BIAS:
            raise bad_request(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries", param="logit_bias")
        choices = num_prompts * req.n
        if choices > self.async_engine.max_queue:
            # It could never be queued: a 429 would invite retries that cannot succeed.
            raise bad_request(
                f"this request needs {choices} engine requests (prompts x n), more than the server queues at once "
                f"({self.async_engine.max_queue}, --max-queue)", param="n" if num_prompts == 1 else "prompt",
            )

    def prepare(
        self, prompt: str | Sequence[int], params: SamplingParams, requested_max: int | None, param: str
    ) -> tuple[list[int], SamplingParams]:
        """Tokenize and validate. ``params`` were built with a provisional max_tokens: with
        ``requested_max`` None the completion gets whatever the context (and the KV cache) leaves, else
        prompt plus max_tokens must fit in both."""
        try:
            ids = self.engine.prepare(prompt, params)
        except SamplingParamError:
            raise  # about a field of its own (a schema the grammar engine cannot compile): a 400 naming it
        except ValueError as exc:
            raise bad_request(str(exc), param=param, code="invalid_prompt") from None
        capacity = self.engine.kv_capacity_tokens
        if requested_max is None:
            room = min(self.max_model_len, capacity) - len(ids)
            if room < 1:
                raise _beyond_kv_cache(len(ids), None, capacity, param)
            return ids, dataclasses.replace(params, max_tokens=room)
        need = len(ids) + params.max_tokens
        if need > self.max_model_len:
            raise bad_request(
                f"this model's maximum context length is {self.max_model_len} tokens, but {need} were requested "
                f"({len(ids)} in the prompt, {params.max_tokens} for the completion); reduce the prompt or max_tokens",
                param="max_tokens", code="context_length_exceeded",
            )
        if need > capacity:
            raise _beyond_kv_cache(len(ids), params.max_tokens, capacity, "max_tokens")
        return ids, params

    def provisional_max(self, requested_max: int | None) -> int:
        return requested_max if requested_max is not None else self.max_model_len - 1

    def submit(self, requests: list[EngineRequest], info: RequestInfo | None = None) -> RequestHandle:
        tracker = None
        if self.tracking is not None and info is not None:
            tracker = self.tracking.start(info, [r.request_id for r in requests])
        try:
            return self.async_engine.submit(requests, tracker, self.limits.request_timeout)
        except QueueFullError as exc:
            raise APIError(
                429, f"the server is busy: {exc}; retry later", type="rate_limit_error", code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        except (NotAcceptingError, EngineDeadError) as exc:
            raise unavailable(str(exc)) from None


def _beyond_kv_cache(num_prompt: int, max_tokens: int | None, capacity: int, param: str) -> APIError:
    """A request that could never be scheduled, refused rather than left waiting forever."""
    if max_tokens is None:
        asked = f"the prompt has {num_prompt} tokens and needs room for at least one more"
    else:
        asked = f"the prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) is {num_prompt + max_tokens} tokens"
    return bad_request(
        f"{asked}, but the whole KV cache holds {capacity} tokens, so this request could never be scheduled; "
        "reduce the prompt or max_tokens", param=param, code="kv_cache_exceeded",
    )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sampling_params(
    req: SamplingFields, max_tokens: int, logprobs: int | None, vocab_size: int, constraint: Constraint | None = None,
    token_healing: bool = False,
) -> SamplingParams:
    """The request's fields as SamplingParams (their range errors name the field: a 400 upstream).
    ``token_healing``: the server's default, for requests that leave it unset and have no constraint (the
    two do not combine: asked for explicitly, that is a 400 naming token_healing)."""
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise bad_request(f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})", "logit_bias")
        bias[token] = value
    stop_ids = tuple(req.stop_token_ids or ())
    if any(not 0 <= t < vocab_size for t in stop_ids):
        raise bad_request(f"stop_token_ids must be in [0, {vocab_size})", param="stop_token_ids")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=bias,
        seed=req.seed,
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        num_speculative_tokens=req.num_speculative_tokens,
        constraint=constraint,
        token_healing=req.token_healing if req.token_healing is not None else token_healing and constraint is None,
    )


def choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """Choice i of n: with a seed, seed + i, so choices differ yet each is reproducible."""
    if params.seed is None or i == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + i)


@dataclass
class Choice(CompletionOutput):
    """One choice's accumulated output, with its place in the response."""

    index: int = 0
    started: bool = False


def usage(choices: Sequence[Choice], num_prompt_tokens: int, n: int = 1) -> Usage:
    """``n`` choices per prompt. Like prompt_tokens, cached tokens count once per prompt: those its
    first choice found cached (its siblings then reuse what it computed, which is not a saving
    across requests)."""
    completion = sum(len(c.token_ids) for c in choices)
    cached = sum(c.num_cached_tokens for c in choices if c.index % n == 0)
    return Usage(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=completion,
        total_tokens=num_prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        spec_draft_tokens=sum(c.num_draft_tokens for c in choices),
        spec_accepted_tokens=sum(c.num_accepted_tokens for c in choices),
        spec_by_method=by_method(choices),
    )


def by_method(choices: Sequence[Choice]) -> dict[str, SpecMethodUsage] | None:
    """The choices' drafted and accepted tokens by draft method, sorted by name; None when nothing was drafted."""
    out: dict[str, SpecMethodUsage] = {}
    for c in choices:
        for name, t in c.spec_by_source.items():
            u = out.setdefault(name, SpecMethodUsage())
            u.draft_tokens += t.num_draft_tokens
            u.accepted_tokens += t.num_accepted_tokens
    return dict(sorted(out.items())) or None


async def collect(handle: RequestHandle, choices: dict[str, Choice]) -> None:
    async for out in handle.outputs():
        choices[out.request_id].add(out)


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first: then cancel it (which aborts its engine
    requests) and raise ClientGoneError. A plain (non-streaming) route is not cancelled by the
    server when its client leaves, so it has to watch by itself."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watch.cancel()
        raise
    watch.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientGoneError()
    return task.result()
