"""A client that goes away, streaming or not, aborts its request: running count and KV usage return
to zero within a step or so, long before the request would have finished."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL, slow_steps

pytestmark = pytest.mark.timeout(60)

LONG = {"model": MODEL, "prompt": "def fib(n):", "max_tokens": 480, "temperature": 0.0, "ignore_eos": True}


def aborted(live) -> float:
    return live.metric("specd:request_failure_total", model_name=MODEL, reason="client_disconnect")


def test_stream_disconnect_aborts_the_request_and_frees_its_blocks(server, monkeypatch):
    # 480 tokens would take 5 s or more: the client reads its 3 events long before, however loaded the machine
    slow_steps(monkeypatch, server.engine, 0.05)
    before = aborted(server)
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}) as resp:
            assert resp.status_code == 200
            events = 0
            for line in resp.iter_lines():
                events += line.startswith("data:")
                if events == 3:
                    break
            assert server.engine.num_running == 1 and server.engine.block_manager.usage > 0
    server.wait_idle(timeout=5.0)
    assert aborted(server) == before + 1


def test_non_streaming_disconnect_aborts_the_request_too(server, monkeypatch):
    slow_steps(monkeypatch, server.engine, 0.01)
    before = aborted(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json={**LONG, "n": 2}, timeout=0.5)
    server.wait_idle(timeout=5.0)
    assert aborted(server) == before + 2
