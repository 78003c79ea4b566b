"""Fault injection: a failure while serving one request (NaN logits for its sequence, a detokenizer error on its
text) fails that request alone, with a 500 that carries no details or an SSE error event then [DONE], while the
requests in flight beside it complete, correctly. (An engine-loop crash is test_errors' and test_cli's.)"""

from __future__ import annotations

import asyncio

import pytest

from tests.engine.lossless import Reference, assert_equal_unless_near_tie, prompts_for
from tests.server.conftest import MODEL, slow_steps, tiny_engine
from tests.server.traffic import client, complete

pytestmark = pytest.mark.timeout(120)

POISON = [283, 284, 285, 286]
MAX_TOKENS = 24


def poisoned(seq) -> bool:
    return seq.token_ids[: len(POISON)] == POISON


@pytest.fixture
def live(make_server, model_sets, monkeypatch):
    ms = model_sets["llama"]
    server = make_server(engine=tiny_engine(ms.target, ms.draft, k=4), draft_model=str(ms.draft))
    slow_steps(monkeypatch, server.engine, 0.002)  # the failing requests fail while the others are mid-flight
    return server


def inject_nan(engine, monkeypatch) -> None:
    forward = engine._forward

    def nan_for_the_poisoned(scheduled, drafts):
        logits = forward(scheduled, drafts)
        row = 0
        for s, d in zip(scheduled, drafts):
            r = len(d) + 1 if s.samples else 0
            if r and poisoned(s.seq) and s.seq.num_output_tokens >= 3:
                logits[row : row + r] = float("nan")
            row += r
        return logits

    monkeypatch.setattr(engine, "_forward", nan_for_the_poisoned)


def inject_detokenizer_error(engine, monkeypatch) -> None:
    check = engine.scheduler.stop.check

    def failing(seq, token):
        if poisoned(seq) and seq.num_output_tokens >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte in /secret/path.py")
        return check(seq, token)

    monkeypatch.setattr(engine.scheduler.stop, "check", failing)


async def traffic(live, good: list[list[int]]):
    base = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    async with client(live.url) as http:
        work = [complete(http, {**base, "prompt": p}, stream=i % 2 == 0) for i, p in enumerate(good)]
        work += [complete(http, {**base, "prompt": POISON + [9, 9]}, stream=s) for s in (False, True)]
        return await asyncio.gather(*work)


@pytest.mark.parametrize("inject", [inject_nan, inject_detokenizer_error], ids=["nan-logits", "detokenizer"])
def test_one_failing_request_gets_an_error_while_the_others_complete_correctly(
    live, model_sets, tokenizer_dir, monkeypatch, inject
):
    good = prompts_for(tokenizer_dir)[:6]
    failures = live.metric("specd:request_failure_total", model_name=MODEL, reason="error")
    inject(live.engine, monkeypatch)
    *results, plain, streamed = asyncio.run(traffic(live, good))

    assert plain.status == 500 and plain.error["type"] == "server_error" and plain.error["code"] == "internal_error"
    for secret in ("Traceback", "/secret", ".py", "utf-8", "NaN"):
        assert secret not in plain.body
    assert streamed.status == 200 and streamed.events[-1] == "[DONE]"
    assert streamed.error is not None and streamed.error["type"] == "server_error"
    assert len(streamed.token_ids) >= 2, "it failed mid-flight, after streaming a few tokens"
    assert all("/secret" not in e for e in streamed.events)

    ref = Reference(model_sets["llama"].target)
    for i, (p, r) in enumerate(zip(good, results)):
        assert r.status == 200 and r.error is None and r.finish_reason in ("stop", "length"), r
        assert_equal_unless_near_tie(ref, p, r.token_ids, ref.greedy(p, MAX_TOKENS), f"request {i} beside a failure")
    live.wait_idle()
    assert live.metric("specd:request_failure_total", model_name=MODEL, reason="error") == failures + 2
    assert live.get("/health").status_code == 200
