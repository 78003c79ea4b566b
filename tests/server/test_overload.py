"""Overload: a burst far above capacity is served or refused with 429 (never a 5xx, never a hang); admission knows
the KV cache's size, so a request that could never fit is a 400 naming the numbers and long prompts share the
cache through preemption; --request-timeout aborts what runs too long (504, or an SSE error event then [DONE])."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.sched.block_manager import BlockManager
from tests.engine.lossless import Reference, assert_equal_unless_near_tie
from tests.server.conftest import MODEL, slow_steps, tiny_engine
from tests.server.test_errors import error_of
from tests.server.traffic import bounded, client, complete

pytestmark = pytest.mark.timeout(120)

GREEDY = {"model": MODEL, "temperature": 0.0}


def assorted(n: int, length: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 280 + 3 for j in range(length + i % 3)] for i in range(n)]


def test_a_burst_far_above_capacity_is_served_correctly_or_refused_with_429(
    make_server, model_sets, monkeypatch, capsys
):
    live = make_server(engine=tiny_engine(model_sets["llama"].target, max_num_seqs=4), max_queue=8)
    slow_steps(monkeypatch, live.engine, 0.005)
    prompts = assorted(4, 6)
    burst = 120

    async def scenario():
        async with client(live.url, concurrency=burst) as http:
            work = [complete(http, {**GREEDY, "prompt": prompts[i % 4], "max_tokens": 16}, stream=i % 2 == 1)
                    for i in range(burst)]
            return await asyncio.wait_for(bounded(work, burst), timeout=90)  # a hang fails here

    results = asyncio.run(scenario())
    assert {r.status for r in results} <= {200, 429}, sorted({r.status for r in results})
    served = [(i, r) for i, r in enumerate(results) if r.status == 200]
    refused = [r for r in results if r.status == 429]
    assert served and refused, f"{len(served)} served, {len(refused)} refused: the burst did not overflow"
    for r in refused:
        assert r.retry_after == "1" and r.error["type"] == "rate_limit_error" and r.error["code"] == "queue_full"
    ref = Reference(model_sets["llama"].target)
    for i, r in served:
        p = prompts[i % 4]
        assert r.error is None and r.finish_reason in ("stop", "length"), r
        assert_equal_unless_near_tie(ref, p, r.token_ids, ref.greedy(p, 16), f"burst request {i}")
    live.wait_idle()
    assert live.get("/health").status_code == 200
    with capsys.disabled():
        print(f"\nburst: {burst} at once, {len(served)} served correctly, {len(refused)} refused with 429")


def shrink_kv_cache(engine, blocks: int) -> None:
    """A cache smaller than one context (which the loader refuses to build): what a GPU short of memory
    would have if it allowed it, and what admission must cope with."""
    small = BlockManager(blocks, engine.block_manager.block_size)
    engine.block_manager = small
    engine.scheduler.block_manager = small


def test_a_request_that_could_never_fit_the_kv_cache_is_a_400_naming_the_numbers(make_server, chat_target):
    engine = tiny_engine(chat_target)
    shrink_kv_cache(engine, 8)  # 128 tokens; the context is 512
    live = make_server(engine=engine)
    err = error_of(live.post("/v1/completions", {**GREEDY, "prompt": [5] * 100, "max_tokens": 40}), 400)
    assert err["code"] == "kv_cache_exceeded" and err["param"] == "max_tokens"
    assert "(100 tokens) plus max_tokens (40) is 140 tokens" in err["message"] and "holds 128 tokens" in err["message"]
    err = error_of(live.post("/v1/completions", {**GREEDY, "prompt": [5] * 130, "max_tokens": None}), 400)
    assert err["code"] == "kv_cache_exceeded" and "130" in err["message"] and "128" in err["message"]
    rest = live.post("/v1/completions", {**GREEDY, "prompt": [5] * 100, "max_tokens": None, "ignore_eos": True})
    assert rest.status_code == 200 and rest.json()["usage"]["completion_tokens"] == 28, "the rest of what fits"
    live.wait_idle()


def test_long_prompts_are_admitted_as_blocks_allow_and_preemption_finishes_them_all(
    make_server, model_sets, monkeypatch
):
    engine = tiny_engine(model_sets["llama"].target)
    shrink_kv_cache(engine, 8)  # 128 tokens: each request (60 + 40) fits alone, no two fit together
    preempted = []
    preempt = engine.scheduler._preempt
    monkeypatch.setattr(engine.scheduler, "_preempt", lambda seq: preempted.append(seq.request_id) or preempt(seq))
    live = make_server(engine=engine)
    prompts = assorted(6, 60)

    async def scenario():
        async with client(live.url) as http:
            work = [complete(http, {**GREEDY, "prompt": p, "max_tokens": 40}, stream=i % 2 == 0)
                    for i, p in enumerate(prompts)]
            return await asyncio.wait_for(asyncio.gather(*work), timeout=90)

    results = asyncio.run(scenario())
    assert preempted, "the cache was shared by preemption"
    ref = Reference(model_sets["llama"].target)
    for i, (p, r) in enumerate(zip(prompts, results)):
        assert r.status == 200 and r.error is None, r
        assert_equal_unless_near_tie(ref, p, r.token_ids, ref.greedy(p, 40), f"long prompt {i}")
    live.wait_idle()


def test_request_timeout_aborts_running_and_waiting_requests_with_504_or_an_sse_error(
    make_server, model_sets, monkeypatch
):
    live = make_server(engine=tiny_engine(model_sets["llama"].target, max_num_seqs=1), request_timeout=2.0)
    slow_steps(monkeypatch, live.engine, 0.02)  # 480 tokens would take 10 s
    before = live.metric("specd:request_failure_total", model_name=MODEL, reason="timeout")
    long = {**GREEDY, "prompt": "def fib(n):", "max_tokens": 480, "ignore_eos": True}

    async def scenario():
        async with client(live.url) as http:
            return await asyncio.gather(complete(http, long, stream=True), complete(http, long, stream=False))

    started = time.monotonic()
    streamed, plain = asyncio.run(scenario())  # one runs, the other waits for the only batch slot
    assert time.monotonic() - started < 8
    assert plain.status == 504 and plain.error["code"] == "request_timeout" and plain.error["type"] == "server_error"
    assert "within 2 s" in plain.error["message"]
    assert streamed.status == 200 and streamed.events[-1] == "[DONE]" and streamed.error["code"] == "request_timeout"
    live.wait_idle()
    assert live.metric("specd:request_failure_total", model_name=MODEL, reason="timeout") == before + 2
    quick = live.post("/v1/completions", {**GREEDY, "prompt": "def", "max_tokens": 2})
    assert quick.status_code == 200, "a request within the deadline is unaffected"
