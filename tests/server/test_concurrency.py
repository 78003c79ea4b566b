"""Continuous batching must not change outputs: 32 concurrent greedy requests each equal their solo
run and the target decoding alone (speculation on, with the draft)."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM, SamplingParams
from tests.engine.lossless import Reference, assert_equal_unless_near_tie
from tests.server.conftest import MODEL

pytestmark = pytest.mark.timeout(90)

MAX_TOKENS = 24


def prompts(tokenizer) -> list[list[int]]:
    texts = ["def fib(n):", "for i in range(10):", "class Point:\n    def", "import os\nprint("]
    out = [tokenizer.encode(t) for t in texts]
    out += [[(7 * i + j) % 290 + 3 for j in range(3 + i % 11)] for i in range(28)]  # assorted lengths
    return out


async def _all_at_once(live, batch: list[list[int]]) -> list[list[int]]:
    async with live.async_client() as client:
        resps = await asyncio.gather(*[
            client.completions.create(
                model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"return_token_ids": True}
            )
            for p in batch
        ])
    return [r.choices[0].model_extra["token_ids"] for r in resps]


def test_32_concurrent_requests_equal_their_solo_runs_and_the_target_alone(server, model_sets, monkeypatch):
    batch = prompts(server.engine.tokenizer)
    assert len(batch) == 32
    metrics = server.state.metrics
    observe, batch_sizes, drafts = metrics.observe_step, [], []

    def record(step, outputs):
        batch_sizes.append(step.num_scheduled)
        drafts.append(step.num_draft_tokens)
        observe(step, outputs)

    monkeypatch.setattr(metrics, "observe_step", record)
    concurrent = asyncio.run(_all_at_once(server, batch))
    assert max(batch_sizes) >= 16, f"requests were not batched together: {batch_sizes}"
    assert sum(drafts) > 0, "speculation was on"
    monkeypatch.undo()
    client = server.client()
    solo = [
        client.completions.create(
            model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"return_token_ids": True}
        ).choices[0].model_extra["token_ids"]
        for p in batch
    ]
    alone = LLM(str(model_sets["llama"].target), dtype="float32", device="cpu")  # no drafter
    want = [o.token_ids for o in alone.generate(batch, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))]
    ref = Reference(model_sets["llama"].target)
    for i, p in enumerate(batch):
        assert_equal_unless_near_tie(ref, p, solo[i], want[i], f"prompt {i} solo")
        assert_equal_unless_near_tie(ref, p, concurrent[i], want[i], f"prompt {i} concurrent")
    server.wait_idle()
