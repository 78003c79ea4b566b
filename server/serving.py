"""What both generation endpoints need of the loaded engine: the server's limits, the checks that
need the engine (model name, prompt tokens, room in the context and the KV cache), sampling
parameters, and submission."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine import Constraint, LLMEngine, SamplingParamError, SamplingParams
from server.async_engine import AsyncEngine, EngineDeadError, NotAcceptingError, QueueFullError
from server.errors import APIError, bad_request, unavailable
from server.generation import Generation, Prepared, fan_out
from server.logprobs import TokenText
from server.params import sampling_params
from server.protocol import SamplingFields
from server.request_stats import RequestInfo, RequestTracking

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
    max_logprobs: int = 20


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
        for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
            value = getattr(req, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > limits.max_logprobs:
                raise bad_request(f"{name} must be at most {limits.max_logprobs} on this server (--max-logprobs), "
                                  f"got {value}", param=name)
        if len(req.logit_bias or {}) > MAX_LOGIT_BIAS:
            raise bad_request(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries", param="logit_bias")
        choices = num_prompts * req.n
        if choices > self.async_engine.max_queue:
            # It could never be queued: a 429 would invite retries that cannot succeed.
            raise bad_request(
                f"this request needs {choices} engine requests (prompts x n), more than the server queues at once "
                f"({self.async_engine.max_queue}, --max-queue)", param="n" if num_prompts == 1 else "prompt",
            )

    def sampling_params(
        self, req: SamplingFields, max_tokens: int | None, logprobs: int | None, constraint: Constraint | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Provisional until ``prepare`` fits max_tokens to the prompt: without one, the whole context."""
        provisional = max_tokens if max_tokens is not None else self.max_model_len - 1
        vocab_size, healing = self.engine.vocab_size, self.limits.token_healing
        return sampling_params(req, provisional, logprobs, vocab_size, constraint, healing, prompt_logprobs)

    def prepare(
        self, prompt: str | Sequence[int], params: SamplingParams, requested_max: int | None, param: str
    ) -> Prepared:
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

    def submit(
        self, kind: str, arrival: float, prompts: Sequence[Prepared], n: int, text: Callable[[], str]
    ) -> Generation:
        """Queue every prompt's n choices at once or none: 429 when the queue is full, 503 when the engine
        stops. ``kind`` prefixes the response id; ``text`` gives the prompt for --log-request-text."""
        request_id = f"{kind}-{uuid.uuid4().hex}"
        requests, choices = fan_out(request_id, prompts, n)
        num_prompt_tokens = sum(len(ids) for ids, _ in prompts)
        tracker = None
        if self.tracking is not None:
            info = RequestInfo(request_id, arrival, num_prompt_tokens, text)
            tracker = self.tracking.start(info, [r.request_id for r in requests])
        try:
            handle = self.async_engine.submit(requests, tracker, self.limits.request_timeout)
        except QueueFullError as exc:
            raise APIError(
                429, f"the server is busy: {exc}; retry later", type="rate_limit_error", code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        except (NotAcceptingError, EngineDeadError) as exc:
            raise unavailable(str(exc)) from None
        return Generation(request_id, n, num_prompt_tokens, choices, handle)


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
