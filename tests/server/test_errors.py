"""Every error path answers in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, slow_steps, tiny_engine

pytestmark = pytest.mark.timeout(60)


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_api_key_is_required_on_v1_but_not_on_health_or_metrics(make_server):
    live = make_server(api_key="sekret")
    ok = live.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert ok.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        live.client(api_key="wrong").completions.create(model=MODEL, prompt="x", max_tokens=2)
    err = error_of(httpx.get(live.url + "/v1/models"), 401)
    assert err["code"] == "invalid_api_key"
    error_of(httpx.get(live.url + "/v1/models", headers={"Authorization": "Basic sekret"}), 401)
    assert live.get("/health").status_code == 200 and live.get("/metrics").status_code == 200


def test_unknown_model_is_404_and_unknown_routes_answer_in_the_same_shape(server):
    with pytest.raises(openai.NotFoundError) as exc:
        server.client().completions.create(model="gpt-17", prompt="x", max_tokens=2)
    assert exc.value.body["code"] == "model_not_found" and exc.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        server.client().models.retrieve("gpt-17")
    error_of(httpx.get(server.url + "/v2/nothing"), 404)


COMPLETION_CASES = [
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({}, "prompt"),
    ({"prompt": {"text": "x"}}, "prompt"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "temperature": 3}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -1}, "top_k"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "presence_penalty": 5}, "presence_penalty"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 1000}}, "logit_bias"),
    ({"prompt": "x", "min_tokens": 20, "max_tokens": 4}, "min_tokens"),
    ({"prompt": "x", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [5, 99999]}, "prompt"),
    ({"prompt": [[5, 6], [-1]]}, "prompt"),
]


COMPLETION_IDS = [f"{param}-{i}" for i, (_, param) in enumerate(COMPLETION_CASES)]


@pytest.mark.parametrize(("body", "param"), COMPLETION_CASES, ids=COMPLETION_IDS)
def test_invalid_completion_fields_are_400_naming_the_field(server, body, param):
    err = error_of(server.post("/v1/completions", {"model": MODEL, **body}), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert "Traceback" not in err["message"]


CHAT_CASES = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools.0.function"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 600}, "max_tokens"),
]


@pytest.mark.parametrize(("body", "param"), CHAT_CASES, ids=[p for _, p in CHAT_CASES])
def test_invalid_chat_fields_are_400_naming_the_field(server, body, param):
    err = error_of(server.post("/v1/chat/completions", {"model": MODEL, **body}), 400)
    assert err["param"] == param


def test_malformed_json_is_400_not_422(server):
    headers = {"content-type": "application/json"}
    error_of(httpx.post(server.url + "/v1/completions", content=b"{not json", headers=headers), 400)


def test_prompt_and_max_tokens_beyond_the_context_give_both_numbers(server):
    ids = [5] * 500
    with pytest.raises(openai.BadRequestError) as exc:
        server.client().completions.create(model=MODEL, prompt=ids, max_tokens=20)
    body = exc.value.body
    assert body["code"] == "context_length_exceeded" and body["param"] == "max_tokens"
    for part in ("512", "520", "500 in the prompt", "20 for the completion"):
        assert part in body["message"]
    err = error_of(server.post("/v1/completions", {"model": MODEL, "prompt": [5] * 600}), 400)
    assert err["param"] == "prompt" and "600" in err["message"] and "512" in err["message"]


def test_full_waiting_queue_is_429_with_retry_after(make_server, model_sets, monkeypatch):
    live = make_server(engine=tiny_engine(model_sets["llama"].target, max_num_seqs=1), max_queue=1)
    slow_steps(monkeypatch, live.engine, 0.01)
    body = {"model": MODEL, "prompt": "def", "temperature": 0.0, "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", live.url + "/v1/completions", json={**body, "max_tokens": 480, "stream": True}) as a:
            lines = a.iter_lines()  # hold it: a dropped line iterator closes the connection (an abort)
            next(line for line in lines if line.startswith("data:"))  # A runs: the only batch slot
            b = threading.Thread(target=live.post, args=("/v1/completions", {**body, "max_tokens": 4}), daemon=True)
            b.start()
            live.wait_until(lambda: live.engine.num_waiting == 1, what="B to wait")
            resp = live.post("/v1/completions", {**body, "max_tokens": 4})
            err = error_of(resp, 429)
            assert resp.headers["retry-after"] == "1" and err["type"] == "rate_limit_error"
            with pytest.raises(openai.RateLimitError):
                live.client().completions.create(model=MODEL, prompt="def", max_tokens=2)
    b.join(10)  # A was aborted on leaving; B got its slot and finished
    assert not b.is_alive()
    live.wait_idle()


def test_internal_error_is_500_with_no_details_in_the_body(server, monkeypatch, caplog):
    def boom(*args, **kwargs):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(server.engine.tokenizer, "encode", boom)
    with caplog.at_level("ERROR", logger="server.errors"):
        resp = server.post("/v1/completions", {"model": MODEL, "prompt": "def fib", "max_tokens": 2})
    err = error_of(resp, 500)
    assert err["type"] == "server_error" and "secret" not in resp.text and "Traceback" not in resp.text
    assert "secret internal detail" in caplog.text, "the details go to the log"
    with pytest.raises(openai.InternalServerError):
        server.client().completions.create(model=MODEL, prompt="def fib", max_tokens=2)


def test_an_error_after_the_stream_began_is_an_sse_event_then_done(server, monkeypatch):
    import server.completions as completions

    real, calls = completions.completion_logprobs, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("formatting broke")
        return real(*args, **kwargs)

    monkeypatch.setattr(completions, "completion_logprobs", flaky)
    body = {"model": MODEL, "prompt": "def", "max_tokens": 200, "logprobs": 1, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        events = [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    assert '"error"' in events[-2] and '"server_error"' in events[-2] and "formatting broke" not in events[-2]
    assert all('"error"' not in e for e in events[:-2])
    server.wait_idle()
    calls.clear()
    stream = server.client().completions.create(
        model=MODEL, prompt="def", max_tokens=200, logprobs=1, stream=True, extra_body={"ignore_eos": True}
    )
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass


def test_engine_crash_fails_requests_turns_health_503_and_asks_to_exit(make_server, monkeypatch):
    live = make_server()
    step, calls = live.engine.step, []

    def crashing():
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("CUDA fell over")
        return step()

    monkeypatch.setattr(live.engine, "step", crashing)
    body = {"model": MODEL, "prompt": "def", "max_tokens": 50, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=30) as resp:
        events = [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data:")]
    assert events[-1] == "[DONE]" and '"engine_dead"' in events[-2]
    assert live.get("/health").status_code == 503 and live.get("/health").json() == {"status": "failed"}
    assert len(live.fatal) == 1 and "CUDA fell over" in str(live.fatal[0])
    err = error_of(live.post("/v1/completions", {"model": MODEL, "prompt": "x"}), 503)
    assert err["type"] == "server_error"
