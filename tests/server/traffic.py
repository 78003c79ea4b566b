"""Client side of the reliability tests: concurrent completions over httpx, streamed or not, read to the end or
dropped part-way, each summarised as a Result."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass, field

import httpx


@dataclass
class Result:
    status: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: dict | None = None  # the error body, or the in-band SSE error event
    events: list[str] = field(default_factory=list)
    dropped: bool = False
    retry_after: str | None = None
    body: str = ""


def client(url: str, concurrency: int = 64, api_key: str = "unused") -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=url, timeout=60, headers={"Authorization": f"Bearer {api_key}"},
        limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
    )


async def complete(http: httpx.AsyncClient, body: dict, stream: bool = False, drop_after: int | None = None) -> Result:
    """POST /v1/completions with return_token_ids. ``drop_after`` (streams only): close the connection after that
    many events (0: as soon as the headers arrive), as a client that goes away."""
    body = {**body, "return_token_ids": True}
    if not stream:
        resp = await http.post("/v1/completions", json=body)
        if resp.status_code != 200:
            return _error(resp.status_code, resp.text, resp.headers)
        choice = resp.json()["choices"][0]
        return Result(200, choice["token_ids"], choice["finish_reason"], body=resp.text)
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return _error(resp.status_code, resp.text, resp.headers)
        result = Result(200)
        if drop_after == 0:
            result.dropped = True
            return result
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = line.removeprefix("data: ")
            result.events.append(event)
            if event != "[DONE]":
                chunk = json.loads(event)
                if "error" in chunk:
                    result.error = chunk["error"]
                for c in chunk.get("choices", []):
                    result.token_ids.extend(c.get("token_ids") or [])
                    result.finish_reason = c.get("finish_reason") or result.finish_reason
            if drop_after is not None and len(result.events) >= drop_after and result.finish_reason is None:
                result.dropped = True
                return result  # leaving the block closes the connection mid-stream
    return result


def _error(status: int, text: str, headers: httpx.Headers) -> Result:
    try:
        error = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        error = None
    return Result(status, error=error, retry_after=headers.get("retry-after"), body=text)


async def bounded(work: Iterable[Awaitable[Result]], concurrency: int) -> list[Result]:
    """Run ``work`` with at most ``concurrency`` requests in flight; results in order."""
    gate = asyncio.Semaphore(concurrency)

    async def one(w: Awaitable[Result]) -> Result:
        async with gate:
            return await w

    return await asyncio.gather(*(one(w) for w in work))
