"""One measured run: a prompt set's items through one system at one concurrency, streamed, timed per request."""

from __future__ import annotations

import asyncio
import os
import re
import time
from dataclasses import dataclass

import httpx
from bench_serving import Result, send  # benchmarks/ is on sys.path (compare.py puts it there)

from .systems import Running
from .workload import Conversation, Item, Request, as_request, needs_server, requests_in

# specd's counters that the acceptance rate and the speedup bound are computed from; llama-server
# (with --metrics) exports the first three under the same names with its own prefix.
SPECD_COUNTERS = (
    "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
    "engine_steps", "engine_step_seconds", "target_forward_seconds", "draft_seconds", "generation_tokens",
    "grammar_seconds", "prefill_step_seconds", "uncompiled_forwards", "compiled_prompt_forwards",
    "eager_prompt_forwards",
)


@dataclass
class Run:
    results: list[Result]
    seconds: float  # first request sent to last response done
    counters: dict[str, float]  # specd's counter increments over the run ({} for other systems)
    foreign_cpu: float | None = None  # share of the machine's CPU time other processes took meanwhile


def cpu_ticks(pids: list[int]) -> tuple[int, int, int]:
    """(all, busy, the processes' own) CPU ticks so far, from /proc; zeros where it cannot be read.
    Noise from other work on the machine shows as busy ticks that are not the processes' own."""
    try:
        with open("/proc/stat") as f:
            cpu = [int(x) for x in f.readline().split()[1:]]
        own = 0
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            own += int(fields[11]) + int(fields[12])  # utime, stime
    except (OSError, ValueError, IndexError):
        return 0, 0, 0
    idle = cpu[3] + (cpu[4] if len(cpu) > 4 else 0)  # idle, iowait
    return sum(cpu[:8]), sum(cpu[:8]) - idle, own  # guest time is already counted in user


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


async def _serve(base_url: str, model: str, items: list[Item], max_tokens: int, concurrency: int,
                 transport: httpx.AsyncBaseTransport | None = None) -> list[Result]:
    """Every item's results, in item order (a conversation's turns in turn order). Up to concurrency
    items run at once; a conversation holds its slot through all its turns, as one agent would."""
    url = base_url + "/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=900, limits=limits, transport=transport) as client:

        async def send_one(req: Request) -> Result:
            body = {"model": model, "prompt": req.prompt, "max_tokens": max_tokens, "temperature": 0.0,
                    "stream": True, **req.extra}
            return await send(client, url, body, chat=False)

        async def one(item: Item) -> list[Result]:
            async with sem:
                if not isinstance(item, Conversation):
                    return [await send_one(as_request(item))]
                out: list[Result] = []
                prompt = item.first
                for _ in range(item.turns):
                    if out and not out[-1].ok:  # the next turn needs this one's output
                        out.append(Result(error="an earlier turn failed"))
                        continue
                    out.append(await send_one(Request(prompt)))
                    prompt = item.next_prompt(prompt, out[-1].text)
                return out

        return [r for rs in await asyncio.gather(*(one(x) for x in items)) for r in rs]


def wait_quiet(share: float, timeout: float) -> bool:
    """Wait, up to timeout seconds, for a 2-second window in which the machine is less than share busy
    (this process and idle servers count too); whether it came."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        a = cpu_ticks([])
        time.sleep(2.0)
        total, busy, _ = (y - x for x, y in zip(a, cpu_ticks([]), strict=True))
        if total <= 0 or busy / total < share:
            return True
    return False


def run(system: Running, prompts: list[Item], max_tokens: int, concurrency: int) -> Run:
    pids = [os.getpid(), system.proc.pid]
    ticks = cpu_ticks(pids)
    out = _run(system, prompts, max_tokens, concurrency)
    total, busy, own = (b - a for a, b in zip(ticks, cpu_ticks(pids), strict=True))
    out.foreign_cpu = max(0.0, busy - own) / total if total > 0 else None
    return out


def measure(system: Running, prompts: list[Item], max_tokens: int, concurrency: int, max_others_cpu: float,
            attempts: int) -> Run:
    """run(), again after waiting for a quiet machine while other processes took more than
    max_others_cpu of the CPU during it, at most attempts times. Interleaving rounds spreads noise over
    the systems, but a busy spell during one run skews that run alone."""
    for attempt in range(1, max(1, attempts) + 1):
        out = run(system, prompts, max_tokens, concurrency)
        if out.foreign_cpu is None or out.foreign_cpu <= max_others_cpu or attempt >= attempts:
            return out
        print(f"  {system.system.name} c{concurrency}: other processes took {out.foreign_cpu:.0%} of the CPU; "
              f"waiting for a quiet machine to measure again", flush=True)
        wait_quiet(max_others_cpu, 600)
    return out


def _run(system: Running, prompts: list[Item], max_tokens: int, concurrency: int) -> Run:
    if system.system.kind == "generate":
        assert concurrency == 1, "generate() systems run one sequence at a time"
        t0 = time.perf_counter()
        results = _generate(system, prompts, max_tokens)
        return Run(results, time.perf_counter() - t0, {})
    before = scrape(system.base_url)
    t0 = time.perf_counter()
    results = asyncio.run(_serve(system.base_url, system.model_id, prompts, max_tokens, concurrency))
    seconds = time.perf_counter() - t0
    after = scrape(system.base_url)
    return Run(results, seconds, {k: after[k] - before.get(k, 0.0) for k in after})


def _generate(system: Running, items: list[Item], max_tokens: int) -> list[Result]:
    """generate() over the items, one sequence at a time: a conversation's turn t+1 is built from turn
    t's output, so every conversation's turn t runs before any turn t+1 (in item order per turn)."""
    assert not any(needs_server(x) for x in items), "generate() takes no response_format"
    per_item: list[list[Result]] = [[] for _ in items]
    prompts = [x.first if isinstance(x, Conversation) else as_request(x).prompt for x in items]
    for turn in range(max(requests_in(x) for x in items)):
        live = [i for i, x in enumerate(items) if requests_in(x) > turn]
        rows = system.generate([prompts[i] for i in live], max_tokens)
        for i, r in zip(live, rows, strict=True):
            per_item[i].append(Result(ok=True, ttft=r["ttft"], latency=r["latency"], text=r["text"],
                                      usage={"target_forwards": r["target_forwards"],
                                             "draft_forwards": r["draft_forwards"]}))
            if isinstance(items[i], Conversation):
                prompts[i] = items[i].next_prompt(prompts[i], r["text"])
    return [r for rs in per_item for r in rs]
