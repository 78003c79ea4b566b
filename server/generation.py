"""One HTTP request's engine requests in flight (its prompts x n choices): each choice's output as it
accumulates, the request's usage, and the two ways to answer: a stream of events, or every choice whole."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import StreamingResponse

from engine import CompletionOutput, RequestOutput, SamplingParams
from server import sse
from server.disconnect import until_disconnect
from server.errors import from_exception
from server.params import choice_params
from server.request_handle import EngineRequest, RequestHandle
from server.responses import PromptTokensDetails, SpecMethodUsage, Usage

Prepared = tuple[list[int], SamplingParams]  # a prompt's token ids, and the params fitted to its length


@dataclass
class Choice(CompletionOutput):
    """One choice's accumulated output, with its place in the response."""

    index: int = 0
    started: bool = False


def fan_out(request_id: str, prompts: Sequence[Prepared], n: int) -> tuple[list[EngineRequest], dict[str, Choice]]:
    """Each choice of each prompt is its own engine request; prompt p's choice i has index p * n + i."""
    requests, choices = [], {}
    for p, (ids, params) in enumerate(prompts):
        for i in range(n):
            index = p * n + i
            engine_id = f"{request_id}-{index}"
            requests.append(EngineRequest(engine_id, ids, choice_params(params, i)))
            choices[engine_id] = Choice(engine_id, ids, index=index)
    return requests, choices


@dataclass
class Generation:
    """A submitted request: read it once, through ``stream`` or ``collect``."""

    id: str
    n: int  # choices per prompt
    num_prompt_tokens: int  # once per prompt, not per choice
    choices: dict[str, Choice]  # engine request id -> its choice
    handle: RequestHandle

    def ordered(self) -> list[Choice]:
        return sorted(self.choices.values(), key=lambda c: c.index)

    async def outputs(self) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Each delta as it comes, with the choice it has just been added to."""
        async for out in self.handle.outputs():
            choice = self.choices[out.request_id]
            choice.add(out)
            yield choice, out

    def stream(self, chunks: AsyncIterator[BaseModel]) -> StreamingResponse:
        """``chunks`` (read from ``outputs``) as server-sent events, then [DONE]."""
        return sse.response(_events(chunks), self.handle.close)

    async def collect(self, request: Request) -> list[Choice]:
        """Every choice, whole and in index order; ClientGoneError if the client leaves first (which
        aborts what is left)."""
        await until_disconnect(request, self._drain())
        return self.ordered()

    async def _drain(self) -> None:
        async for _ in self.outputs():
            pass

    def usage(self) -> Usage:
        """Like prompt_tokens, cached tokens count once per prompt: those its first choice found cached
        (its siblings then reuse what it computed, which is not a saving across requests)."""
        choices = list(self.choices.values())
        completion = sum(len(c.token_ids) for c in choices)
        cached = sum(c.num_cached_tokens for c in choices if c.index % self.n == 0)
        return Usage(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=completion,
            total_tokens=self.num_prompt_tokens + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
            spec_draft_tokens=sum(c.num_draft_tokens for c in choices),
            spec_accepted_tokens=sum(c.num_accepted_tokens for c in choices),
            spec_by_method=_by_method(choices),
        )


def _by_method(choices: Iterable[Choice]) -> dict[str, SpecMethodUsage] | None:
    """The choices' drafted and accepted tokens by draft method, sorted by name; None when nothing was drafted."""
    out: dict[str, SpecMethodUsage] = {}
    for c in choices:
        for name, t in c.spec_by_source.items():
            u = out.setdefault(name, SpecMethodUsage())
            u.draft_tokens += t.num_draft_tokens
            u.accepted_tokens += t.num_accepted_tokens
    return dict(sorted(out.items())) or None


async def _events(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield sse.event(chunk)
    except Exception as exc:  # the status line is sent: report in-band (cancellation is not an Exception)
        yield sse.error_event(from_exception(exc))
    yield sse.DONE
