"""Memory: a real ``specd serve`` process (tiny random target and draft) keeps its resident memory flat over 1,000
mixed requests and ends with nothing running, nothing waiting and an empty KV cache; the KV cache is sized from
--kv-cache-memory-gb (blocks = floor(budget / bytes per block), capped at what max_num_seqs sequences of
max_model_len can use) and the start-up log says so. benchmarks/memory_soak.py is the same soak on the default pair."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time

import httpx
import openai
import psutil
import pytest
from transformers import AutoConfig

from engine import LLMEngine
from server.cli import parse_config
from tests.server.conftest import MODEL
from tests.server.test_cli import Process
from tests.server.traffic import bounded
from tests.tiny_models import CORPUS

pytestmark = pytest.mark.timeout(300)  # a process imports torch: slow on a busy 2-core machine

BUDGET_GB = 0.01  # far below the cap (64 sequences x 33 blocks), so the budget decides
NUM_REQUESTS, WARMUP, CONCURRENCY = 1000, 100, 8
KV_LINE = re.compile(r"KV cache: (\d+) blocks x (\d+) tokens = (\d+) tokens, ([\d.]+) MiB \(([^)]*)\)")


def model_flags(ms, budget_gb: float) -> list[str]:
    return ["--model", str(ms.target), "--draft-model", str(ms.draft), "--dtype", "float32", "--device", "cpu",
            "--kv-cache-memory-gb", str(budget_gb)]


@pytest.fixture(scope="module")
def soak_server(model_sets, tmp_path_factory):
    args = [*model_flags(model_sets["llama"], BUDGET_GB), "--served-model-name", MODEL, "--log-stats-interval", "0"]
    proc = Process(tmp_path_factory.mktemp("memory"), args)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.proc.terminate()
        proc.wait_exit(60)


def kv_bytes_per_block(paths, block_size: int = 16) -> int:
    """From the models' configs alone: K and V, every layer, every KV head, float32, summed over target and draft."""
    total = 0
    for path in paths:
        cfg = AutoConfig.from_pretrained(path)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        total += 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4 * block_size
    return total


def expected_blocks(ms, budget_gb: float, max_num_seqs: int = 64, k_max: int = 8) -> tuple[int, bool]:
    """(blocks, capped) as the loader must size them: 512 positions + k_max drafts + 1, in 16-token blocks."""
    budget = int(budget_gb * 2**30) // kv_bytes_per_block([ms.target, ms.draft])
    cap = -(-(512 + k_max + 1) // 16) * max_num_seqs
    return min(budget, cap), budget > cap


def mixed_requests(n: int, seed: int) -> list[tuple[dict, bool, int | None]]:
    """(body, stream, drop_after): streamed and not, varied prompt lengths and max_tokens, stop strings, n=2,
    seeded sampling, and a few streams dropped after ``drop_after`` chunks (0: as soon as the headers arrive)."""
    rng = random.Random(seed)
    work = []
    for _ in range(n):
        prompt = "".join(rng.choice(CORPUS) for _ in range(rng.choice((1, 1, 2, 3))))[: rng.randint(8, 300)]
        body: dict = {"model": MODEL, "prompt": prompt, "max_tokens": rng.randint(2, 8), "temperature": 0.0}
        if rng.random() < 0.3:
            body.update(temperature=1.0, seed=rng.randrange(2**31))
        if rng.random() < 0.2:
            body["stop"] = rng.choice([["\n"], ["return", ")"], ["x"]])
        if rng.random() < 0.1:
            body["n"] = 2
        stream = rng.random() < 0.5
        drop_after = rng.randint(0, 2) if stream and rng.random() < 0.1 else None
        work.append((body, stream, drop_after))
    return work


async def one(api: openai.AsyncOpenAI, body: dict, stream: bool, drop_after: int | None) -> list[str | None] | str:
    """Each choice's finish_reason, or "dropped". The official client: its SSE decoder splits lines at CR/LF only,
    where httpx's aiter_lines() (traffic.complete) also splits at U+0085/U+2028/U+2029, which a random model's
    text does contain and JSON does not escape."""
    if not stream:
        return [c.finish_reason for c in (await api.completions.create(**body)).choices]
    finish: list[str | None] = [None] * body.get("n", 1)
    async with await api.completions.create(**body, stream=True) as chunks:
        if drop_after == 0:
            return "dropped"
        seen = 0
        async for chunk in chunks:
            seen += 1
            for c in chunk.choices:
                finish[c.index] = c.finish_reason or finish[c.index]
            if drop_after is not None and seen >= drop_after and None in finish:
                return "dropped"  # leaving the block closes the connection mid-stream
    return finish


def run_batch(url: str, work: list[tuple[dict, bool, int | None]]) -> list[list[str | None] | str]:
    async def go() -> list:
        api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        async with api:
            return await bounded((one(api, b, s, d) for b, s, d in work), CONCURRENCY)

    return asyncio.run(go())


def gauges(url: str) -> tuple[float, float, float]:
    """running, waiting, KV usage from /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    names = ("specd:num_requests_running", "specd:num_requests_waiting", "specd:kv_cache_usage_perc")
    values = dict.fromkeys(names, -1.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in values and f'model_name="{MODEL}"' in line:
            values[name] = float(line.rsplit(" ", 1)[1])
    return tuple(values.values())


def test_rss_stays_flat_over_1000_requests(soak_server):
    pid = soak_server.proc.pid
    rss = []  # MiB after each 100 requests, the server idle in between
    work = mixed_requests(NUM_REQUESTS, seed=6)
    started = time.monotonic()
    results: list = []
    for i in range(0, NUM_REQUESTS, WARMUP):
        results += run_batch(soak_server.url, work[i : i + WARMUP])
        rss.append(psutil.Process(pid).memory_info().rss / 2**20)
    seconds = time.monotonic() - started

    for (body, _, _), r in zip(work, results):
        assert r == "dropped" or set(r) <= {"stop", "length"}, (body, r)
    dropped = results.count("dropped")
    assert 0 < dropped <= sum(d is not None for _, _, d in work)  # a short stream may end before its drop point

    base = rss[0]
    drifts = [100 * (m - base) / base for m in rss]
    table = ", ".join(f"{(i + 1) * WARMUP}: {m:.1f} MiB ({d:+.2f}%)" for i, (m, d) in enumerate(zip(rss, drifts)))
    print(f"\n{NUM_REQUESTS} requests in {seconds:.1f}s ({dropped} dropped); RSS {table}")
    assert max(abs(d) for d in drifts) <= 5.0, f"RSS drifted more than 5% after the warm-up: {table}"

    deadline = time.monotonic() + 10
    while (state := gauges(soak_server.url)) != (0.0, 0.0, 0.0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state == (0.0, 0.0, 0.0), f"running, waiting, KV usage at the end: {state}"


def test_the_startup_log_reports_the_kv_cache_sized_from_the_budget_flag(soak_server, model_sets):
    (line,) = list(KV_LINE.finditer(soak_server.log.read_text()))
    blocks, block_size, tokens, mib, source = line.groups()
    want, capped = expected_blocks(model_sets["llama"], BUDGET_GB)
    assert not capped
    assert (int(blocks), int(block_size), int(tokens)) == (want, 16, want * 16)
    per_block = kv_bytes_per_block([model_sets["llama"].target, model_sets["llama"].draft])
    assert float(mib) == pytest.approx(want * per_block / 2**20, abs=0.05)
    assert source == f"budget {BUDGET_GB:g} GiB = {want} blocks"


@pytest.mark.parametrize("budget_gb", [0.005, 0.01, 0.02, 1.0])
def test_changing_the_kv_budget_flag_changes_the_reported_block_count(model_sets, caplog, budget_gb):
    ms = model_sets["llama"]
    config = parse_config(["serve", *model_flags(ms, budget_gb)])
    with caplog.at_level(logging.INFO, logger="engine.core.loader"):
        engine = LLMEngine(config.engine_config())
    (line,) = [m for r in caplog.records if (m := KV_LINE.search(r.getMessage()))]
    want, capped = expected_blocks(ms, budget_gb)
    assert int(line.group(1)) == engine.block_manager.num_blocks == want
    # 0.005 -> 327, 0.01 -> 655, 0.02 -> 1310 blocks; 1 GiB would be 65536, more than 64 sequences can use.
    assert capped == (budget_gb == 1.0)
    assert ("capped at max_num_seqs 64 x 33 blocks per sequence" in line.group(5)) == capped
