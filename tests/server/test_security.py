"""Security defaults: the API key guards every route but /health and /metrics (no open docs or schema routes),
no request text reaches the logs unless --log-request-text, CORS is off unless origins are configured, and
--trust-remote-code is off unless asked for and warned about when on."""

from __future__ import annotations

import logging

import httpx
import pytest

from server.cli import parse_config
from tests.server.conftest import MODEL, tiny_engine
from tests.server.test_faults import inject_nan

pytestmark = pytest.mark.timeout(60)

MARKER = "qzx-marker-5f1c9"  # appears in requests, never in the logs
CLIENT_LOGGERS = ("httpx", "httpcore", "openai", "hpack", "asyncio")


def test_every_route_but_health_and_metrics_needs_the_key(make_server):
    live = make_server(api_key="k3y")
    routes = {path: [m.upper() for m in ops] for path, ops in live.app.openapi()["paths"].items()}
    assert set(routes) == {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model}",
                           "/tokenize", "/detokenize", "/tokenizer_info", "/health", "/metrics"}, (
        "a new route must be behind the key, or added here on purpose")
    for path, methods in routes.items():
        url = live.url + path.replace("{model}", MODEL)
        resp = httpx.request(methods[0], url, json={}, timeout=10)
        if path in ("/health", "/metrics"):
            assert resp.status_code == 200
        else:
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key", path
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(live.url + path, timeout=10).status_code == 404


def _server_log(caplog) -> str:
    return "\n".join(caplog.handler.format(r) for r in caplog.records if not r.name.startswith(CLIENT_LOGGERS))


def test_request_text_never_reaches_the_logs_without_log_request_text(make_server, chat_target, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    live = make_server(engine=tiny_engine(chat_target), log_requests=True)
    text = f"def {MARKER}():"
    ok = [
        ("/v1/completions", {"prompt": text, "max_tokens": 4, "stop": [MARKER], "user": MARKER, "echo": True}),
        ("/v1/completions", {"prompt": [text, text], "max_tokens": 4, "stream": True, "logprobs": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 4}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 4, "stream": True}),
    ]
    for path, body in ok:
        assert live.post(path, {"model": MODEL, **body}).status_code == 200
    bad = [
        {"prompt": text, "logit_bias": {MARKER: 1}},
        {"prompt": text, "stop": [MARKER * 20]},
        {"prompt": text, "temperature": 9},
        {"prompt": text, "max_tokens": 9999},
        {"prompt": text, "model": MARKER},
    ]
    for body in bad:
        assert live.post("/v1/completions", {"model": MODEL, **body}).status_code in (400, 404)
    with httpx.stream("POST", live.url + "/v1/completions", timeout=10,
                      json={"model": MODEL, "prompt": text, "max_tokens": 300, "stream": True}) as resp:
        next(resp.iter_lines())  # then drop it
    monkeypatch.setattr("tests.server.test_faults.POISON", live.engine.encode(text))  # this prompt fails mid-way
    inject_nan(live.engine, monkeypatch)
    failed = live.post("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 10, "ignore_eos": True})
    assert failed.status_code == 500
    live.wait_idle()

    log = _server_log(caplog)
    assert "request cmpl-" in log and "request chatcmpl-" in log, "the request lines were captured"
    assert "failed: the target's logits are not finite" in log, "the failure was logged"
    assert MARKER not in log


def test_log_request_text_is_the_opt_in(make_server, caplog):
    caplog.set_level(logging.INFO)
    live = make_server(log_request_text=True)
    assert live.post("/v1/completions", {"model": MODEL, "prompt": MARKER, "max_tokens": 2}).status_code == 200
    assert MARKER in _server_log(caplog)


def test_cors_headers_are_absent_by_default(server):
    headers = {"Origin": "https://site.example", "Authorization": "Bearer unused"}
    assert "access-control-allow-origin" not in httpx.get(server.url + "/v1/models", headers=headers).headers
    preflight = httpx.options(server.url + "/v1/completions",
                              headers={"Origin": "https://site.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers


def test_cors_allows_exactly_the_configured_origins(make_server):
    live = make_server(cors_allow_origins="https://app.example, https://admin.example")
    allowed = httpx.get(live.url + "/v1/models", headers={"Origin": "https://admin.example"})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "https://admin.example"
    preflight = httpx.options(live.url + "/v1/chat/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
    })
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    other = httpx.get(live.url + "/v1/models", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_trust_remote_code_is_off_by_default_and_warned_about_when_on(make_server, caplog):
    assert parse_config(["serve", "--model", "org/m"]).engine_config().trust_remote_code is False
    assert parse_config(["serve", "--model", "org/m", "--trust-remote-code"]).engine_config().trust_remote_code
    caplog.set_level(logging.WARNING, logger="server.app")
    make_server()
    assert not [r for r in caplog.records if "trust-remote-code" in r.getMessage()]
    make_server(trust_remote_code=True)
    [warning] = [r for r in caplog.records if "trust-remote-code" in r.getMessage()]
    assert warning.levelno == logging.WARNING and "only with models whose code you trust" in warning.getMessage()
