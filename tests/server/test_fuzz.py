"""Schemathesis fuzzes the OpenAPI schema of POST /v1/completions and /v1/chat/completions against a live
server: bodies that fit the schema and bodies that break it. No answer may be a 5xx; every error is in OpenAI's
shape with no traceback or path in it; the server is healthy and correct afterwards. The examples are
derandomized (the same cases on every run) and bounded, so the test takes seconds."""

from __future__ import annotations

import copy
import json
from collections import Counter

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from engine import EngineConfig, LLMEngine
from server.config import ServerConfig
from tests.server.conftest import MODEL, LiveServer

pytestmark = pytest.mark.timeout(300)

EXAMPLES = 120  # requests in all, both routes, valid and invalid bodies
ROUTES = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def fuzz_server(chat_target):
    """Small limits keep the dearest valid request cheap: a 32-token context, n <= 4, 16 queued choices; n-gram
    speculation, so that verification is fuzzed too."""
    engine = LLMEngine(EngineConfig(
        model=str(chat_target), speculative_method="ngram", num_speculative_tokens=4, dtype="float32", device="cpu",
        max_model_len=32,
    ))
    config = ServerConfig(model=str(chat_target), speculative_method="ngram", served_model_name=MODEL, max_n=4,
                          max_queue=16)
    live = LiveServer(config, engine)
    yield live
    live.stop()


def with_server_limits(schema: dict) -> dict:
    """The schema with this server's own limits written in (its model, n <= 4, non-empty prompts of token ids
    in the vocabulary, text content parts, short completions), for the valid half: most of those bodies are then
    really served, so that the engine is fuzzed and not only the validation. The invalid half uses the real one."""
    schema = copy.deepcopy(schema)
    defs = schema["components"]["schemas"]
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 319}, "minItems": 1, "maxItems": 12}
    text = {"type": "string", "minLength": 1, "maxLength": 24}
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = defs[name]["properties"]
        props["model"] = {"anyOf": [{"const": MODEL}, {"type": "null"}]}
        props["n"]["maximum"] = 4
        for key in ("max_tokens", "max_completion_tokens"):
            if key in props:
                props[key]["anyOf"][0]["maximum"] = 16
    defs["CompletionRequest"]["properties"]["prompt"] = {"anyOf": [
        text, {"type": "array", "items": text, "minItems": 1, "maxItems": 3}, ids,
        {"type": "array", "items": ids, "minItems": 1, "maxItems": 3},
    ]}
    defs["ContentPart"]["properties"]["type"] = {"const": "text"}
    return schema


def check_response(case, response: requests.Response) -> None:
    sent = json.dumps(case.body, default=repr)[:500]
    assert response.status_code < 500, f"{case.path} answered {response.status_code} to {sent}: {response.text}"
    if response.status_code >= 400:
        err = response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, response.text
        for leak in ("Traceback", 'File "', "/work/", "site-packages"):
            assert leak not in response.text, response.text


def test_fuzzed_requests_never_get_a_5xx_and_leave_the_server_healthy(fuzz_server, capsys):
    live = fuzz_server
    real = live.app.openapi()
    valid = schemathesis.openapi.from_dict(with_server_limits(real))
    invalid = schemathesis.openapi.from_dict(real)
    cases = st.one_of([
        *(valid[route]["POST"].as_strategy(generation_mode=GenerationMode.POSITIVE) for route in ROUTES),
        *(invalid[route]["POST"].as_strategy(generation_mode=GenerationMode.NEGATIVE) for route in ROUTES),
    ])
    statuses: Counter[tuple[str, int]] = Counter()
    session = requests.Session()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def fuzz(case) -> None:
        response = case.call(base_url=live.url, session=session, timeout=60)
        statuses[(case.path, response.status_code)] += 1
        check_response(case, response)

    fuzz()
    total = sum(statuses.values())
    served = sum(n for (_, status), n in statuses.items() if status == 200)
    assert total >= EXAMPLES * 0.9 and served >= EXAMPLES // 6, statuses
    assert {path for path, _ in statuses} == set(ROUTES), statuses
    live.wait_idle(timeout=30)
    assert live.get("/health").status_code == 200
    ok = live.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                            "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
    by_status = dict(sorted(Counter(status for _, status in statuses.elements()).items()))
    with capsys.disabled():
        print(f"\nfuzz: {total} requests, by status: {by_status}")
