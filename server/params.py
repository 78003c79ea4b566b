"""A request's sampling fields as the engine's SamplingParams."""

from __future__ import annotations

import dataclasses

from engine import Constraint, SamplingParams
from server.errors import bad_request
from server.protocol import SamplingFields


def sampling_params(
    req: SamplingFields, max_tokens: int, logprobs: int | None, vocab_size: int, constraint: Constraint | None = None,
    token_healing: bool = False, prompt_logprobs: int | None = None,
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
        prompt_logprobs=prompt_logprobs,
        num_speculative_tokens=req.num_speculative_tokens,
        constraint=constraint,
        token_healing=req.token_healing if req.token_healing is not None else
        token_healing and constraint is None and prompt_logprobs is None,
    )


def choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """Choice i of n: with a seed, seed + i, so choices differ yet each is reproducible."""
    if params.seed is None or i == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + i)
