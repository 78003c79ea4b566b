"""/health follows the server's life: loading (503), ready (200), draining (503)."""

from __future__ import annotations

import threading

import pytest

from tests.server.conftest import MODEL

pytestmark = pytest.mark.timeout(60)


def test_health_is_503_while_the_model_loads_then_200(make_server):
    loaded = threading.Event()
    holder = {}

    def slow_factory():
        loaded.wait(10)
        return holder["engine"]

    live = make_server(factory=slow_factory)
    holder["engine"] = live.engine
    resp = live.get("/health")
    assert resp.status_code == 503 and resp.json() == {"status": "loading"}
    busy = live.post("/v1/completions", {"model": MODEL, "prompt": "x"})
    assert busy.status_code == 503 and "loading" in busy.json()["error"]["message"]
    loaded.set()
    live.wait_ready()
    assert live.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code == 200


def test_draining_server_answers_503_to_health_and_new_requests(make_server):
    live = make_server()
    live.state.begin_drain()  # what SIGTERM does first
    assert live.get("/health").json() == {"status": "shutting_down"} and live.get("/health").status_code == 503
    resp = live.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert resp.status_code == 503 and resp.json()["error"]["type"] == "server_error"
