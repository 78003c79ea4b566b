"""Every request field is validated: a bad value is a 400 in OpenAI's error shape whose ``param`` names the field
(413 for an oversized body), never a 5xx, and the server goes on serving. Values that are in range but extreme
(a huge top_k, a temperature or top_p that underflows float32, the widest seeds) are served, not crashed on."""

from __future__ import annotations

import json

import httpx
import pytest

from server.config import ServerConfig
from tests.server.conftest import MODEL, LiveServer, tiny_engine
from tests.server.test_errors import error_of

pytestmark = pytest.mark.timeout(120)

BODY_LIMIT = 16384
MAX_N, MAX_STOPS, MAX_QUEUE = 4, 2, 16


@pytest.fixture(scope="module")
def strict(chat_target):
    """A server with small limits of its own: --max-n 4, --max-stop-sequences 2, 16 KiB bodies, 16 queued."""
    config = ServerConfig(
        model=str(chat_target), served_model_name=MODEL, max_n=MAX_N, max_stop_sequences=MAX_STOPS,
        max_body_bytes=BODY_LIMIT, max_queue=MAX_QUEUE,
    )
    live = LiveServer(config, tiny_engine(chat_target))
    yield live
    live.stop()


def assert_still_serving(live: LiveServer) -> None:
    assert live.get("/health").status_code == 200
    ok = live.post("/v1/completions", {"model": MODEL, "prompt": "def fib(n):", "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1, ok.text


def assert_clean_error(resp: httpx.Response, status: int) -> dict:
    err = error_of(resp, status)
    assert "Traceback" not in resp.text and ".py" not in resp.text and "/tmp" not in resp.text
    return err


COMPLETION_CASES = [
    ({"prompt": "x", "n": MAX_N + 1}, "n"),
    ({"prompt": "x", "n": 1.5}, "n"),
    ({"prompt": "x", "stop": ["a", "b", "c"]}, "stop"),
    ({"prompt": "x", "stop": "y" * 257}, "stop"),
    ({"prompt": "x", "stop_token_ids": list(range(3, 260))}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "x", "seed": -(2**63) - 1}, "seed"),
    ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "temperature": 2.01}, "temperature"),
    ({"prompt": "x", "top_p": 1.01}, "top_p"),
    ({"prompt": "x", "top_p": -0.5}, "top_p"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "max_tokens": -5}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**30}, "max_tokens"),
    ({"prompt": "x", "stream": "maybe"}, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": ["def", ""]}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [[5], []]}, "prompt"),
    ({"prompt": [2**70]}, "prompt"),
    ({"prompt": ["a", "b", "c", "d", "e"], "n": 4}, "prompt"),  # 20 engine requests can never queue (16)
]


COMPLETION_IDS = [f"{p}-{i}" for i, (_, p) in enumerate(COMPLETION_CASES)]


@pytest.mark.parametrize(("body", "param"), COMPLETION_CASES, ids=COMPLETION_IDS)
def test_each_invalid_completion_field_is_a_400_naming_it_and_the_server_goes_on(strict, body, param):
    err = assert_clean_error(strict.post("/v1/completions", {"model": MODEL, **body}), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert_still_serving(strict)


USER = [{"role": "user", "content": "hi"}]
CHAT_CASES = [
    ({"messages": USER, "n": MAX_N + 1}, "n"),
    ({"messages": USER, "stop": ["a", "b", "c"]}, "stop"),
    ({"messages": USER, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": USER, "temperature": 2.5}, "temperature"),
    ({"messages": USER, "logit_bias": {"99999": 1}}, "logit_bias"),
    ({"messages": [{"role": "user"}], "seed": 2**65}, "seed"),
    ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.mark.parametrize(("body", "param"), CHAT_CASES, ids=[f"{p}-{i}" for i, (_, p) in enumerate(CHAT_CASES)])
def test_each_invalid_chat_field_is_a_400_naming_it(strict, body, param):
    err = assert_clean_error(strict.post("/v1/chat/completions", {"model": MODEL, **body}), 400)
    assert err["param"] == param, err
    assert_still_serving(strict)


RAW_CASES = [  # bodies no JSON library would write: non-standard numbers, lone surrogates, bad bytes
    (b'{"model": "tiny-llama", "prompt": "x", "temperature": NaN}', "application/json", "temperature"),
    (b'{"model": "tiny-llama", "prompt": "x", "presence_penalty": -Infinity}', "application/json", "presence_penalty"),
    (b'{"model": "tiny-llama", "prompt": "x", "logit_bias": {"5": NaN}}', "application/json", "logit_bias"),
    (b'{"model": "tiny-llama", "prompt": "x\\ud800"}', "application/json", "prompt"),
    (b'{"model": "tiny-llama", "prompt": "caf\xe9"}', "application/json", None),  # Latin-1, not UTF-8
    (b"\x80\x81{}", "application/json", None),
    (b'{"model": "tiny-llama", "prompt": ', "application/json", None),
    (b'{"model": "tiny-llama", "max_tokens": 1' + b"0" * 5000 + b"}", "application/json", None),
    (b"[" * 5000 + b"]" * 5000, "application/json", None),  # deeper than Python's recursion limit
    (b"[1, 2]", "application/json", None),
    (b'"just a string"', "application/json", None),
    (b"", "application/json", None),
    (b'{"model": "tiny-llama", "prompt": "x"}', "text/plain", None),
]


@pytest.mark.parametrize(("content", "content_type", "param"), RAW_CASES, ids=[str(i) for i in range(len(RAW_CASES))])
def test_malformed_bodies_are_a_400_in_the_error_shape(strict, content, content_type, param):
    resp = httpx.post(
        strict.url + "/v1/completions", content=content, headers={"content-type": content_type}, timeout=30
    )
    err = assert_clean_error(resp, 400)
    assert err["param"] == param, err
    assert_still_serving(strict)


def test_a_lone_surrogate_in_chat_messages_is_a_400(strict):
    content = b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "hi \\udfff"}]}'
    resp = httpx.post(strict.url + "/v1/chat/completions", content=content, timeout=30,
                      headers={"content-type": "application/json"})
    assert assert_clean_error(resp, 400)["param"].startswith("messages")
    assert_still_serving(strict)


def test_a_body_over_the_limit_is_a_413_whether_its_length_is_declared_or_chunked(strict):
    big = {"model": MODEL, "prompt": "x" * BODY_LIMIT}
    err = assert_clean_error(strict.post("/v1/completions", big), 413)
    assert err["code"] == "request_too_large" and str(BODY_LIMIT) in err["message"]

    def chunks():
        for _ in range(BODY_LIMIT // 1024 + 1):
            yield b" " * 1024  # JSON whitespace: only the size is wrong

    resp = httpx.post(strict.url + "/v1/completions", content=chunks(), timeout=30,
                      headers={"content-type": "application/json"})
    assert assert_clean_error(resp, 413)["code"] == "request_too_large"
    under = {"model": MODEL, "prompt": "def", "max_tokens": 2, "user": "u" * (BODY_LIMIT - 200)}
    assert strict.post("/v1/completions", under).status_code == 200
    assert_still_serving(strict)


def test_extreme_values_in_range_are_served_not_crashed_on(strict):
    """Each of these once reached a tensor it could break: int64 overflow (top_k, seed), a float32 temperature
    or top_p of 0 (NaN probabilities)."""
    base = {"model": MODEL, "prompt": "def fib(n):", "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
    greedy = strict.post("/v1/completions", {**base, "temperature": 0}).json()["choices"][0]["token_ids"]
    for extra in ({"temperature": 1e-300}, {"temperature": 5e-324, "seed": 3}, {"top_p": 1e-300, "temperature": 1.0}):
        resp = strict.post("/v1/completions", {**base, **extra})
        assert resp.status_code == 200, (extra, resp.text)
        assert resp.json()["choices"][0]["token_ids"] == greedy, f"{extra} is greedy in the limit"
    for extra in ({"top_k": 2**70}, {"seed": 2**64 - 1}, {"seed": -(2**63)}, {"min_p": 1.0}, {"top_p": 1e-30}):
        resp = strict.post("/v1/completions", {**base, "temperature": 1.0, **extra})
        assert resp.status_code == 200, (extra, resp.text)
        assert len(resp.json()["choices"][0]["token_ids"]) == 8
    assert_still_serving(strict)
    strict.wait_idle()


def test_the_limits_are_server_options(strict):
    ok = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    assert strict.post("/v1/completions", {**ok, "n": MAX_N, "stop": ["a", "b"]}).status_code == 200
    assert json.loads(strict.post("/v1/completions", {**ok, "n": MAX_N + 1}).text)["error"]["message"].endswith(
        f"(--max-n), got {MAX_N + 1}"
    )
