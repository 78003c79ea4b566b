"""One measured run: a prompt list through one system at one concurrency, streamed, timed per request."""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass

import httpx
from bench_serving import Result, send  # benchmarks/ is on sys.path (compare.py puts it there)

from .systems import Running

# specd's counters that the acceptance rate and the speedup bound are computed from; llama-server
# (with --metrics) exports the first three under the same names with its own prefix.
SPECD_COUNTERS = (
    "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
    "engine_steps", "engine_step_seconds", "target_forward_seconds", "draft_seconds", "generation_tokens",
)


@dataclass
class Run:
    results: list[Result]
    seconds: float  # first request sent to last response done
    counters: dict[str, float]  # specd's counter increments over the run ({} for other systems)


def scrape(base_url: str) -> dict[str, float]:
    try:
        text = httpx.get(base_url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out = {}
    for name in SPECD_COUNTERS:
        values = re.findall(rf"^(?:specd|llamacpp):{name}_total(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
        if values:
            out[name] = sum(map(float, values))
    return out


async def _serve(base_url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int) -> list[Result]:
    url = base_url + "/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:

        async def one(prompt: str) -> Result:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
            async with sem:
                return await send(client, url, body, chat=False)

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def run(system: Running, prompts: list[str], max_tokens: int, concurrency: int) -> Run:
    if system.system.kind == "generate":
        assert concurrency == 1, "generate() systems run one sequence at a time"
        t0 = time.perf_counter()
        rows = system.generate(prompts, max_tokens)
        seconds = time.perf_counter() - t0
        results = [Result(ok=True, ttft=r["ttft"], latency=r["latency"], text=r["text"],
                          usage={"target_forwards": r["target_forwards"], "draft_forwards": r["draft_forwards"]})
                   for r in rows]
        return Run(results, seconds, {})
    before = scrape(system.base_url)
    t0 = time.perf_counter()
    results = asyncio.run(_serve(system.base_url, system.model_id, prompts, max_tokens, concurrency))
    seconds = time.perf_counter() - t0
    after = scrape(system.base_url)
    return Run(results, seconds, {k: after[k] - before.get(k, 0.0) for k in after})
