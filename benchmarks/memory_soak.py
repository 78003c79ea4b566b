#!/usr/bin/env python
"""Memory soak: does a specd server's resident memory stay flat over many requests?

    python benchmarks/memory_soak.py                                   # the embedded default pair, 1,000 requests
    python benchmarks/memory_soak.py --num-requests 5000 --concurrency 16 --json-out soak.json
    python benchmarks/memory_soak.py --model DIR --draft-model DIR --kv-cache-memory-gb 2 -- --dtype float32

It starts ``python -m server serve`` as a subprocess (no model flags: the embedded default pair in
models/default; extra server flags go after ``--``), waits for /health, and prints the start-up log's
KV cache line, so the budget (--kv-cache-memory-gb) -> blocks sizing is visible. Then it sends
--num-requests requests with a fixed concurrency: a seeded mix of /v1/completions (and a few
/v1/chat/completions), streamed and not, prompts of varied length, max_tokens 8..32, some with stop
strings, some with n=2, some seeded samples, and a few streams dropped mid-way by closing the
connection (the server aborts them). Every --sample-every finished requests it samples the server
process's RSS (psutil, the server's pid) and prints a table: requests done, RSS in MiB and the change
against the RSS after the warm-up (the first --warmup requests, which load every lazily built thing).
The verdict line gives the largest drift after the warm-up in percent, FLAT when it stays within
--max-drift-pct (default 5), and the exit code is 1 when it does not. At the end /metrics must show
nothing running or waiting and an empty KV cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from peer_bench.ports import free_port  # noqa: E402

KV_LINE = re.compile(r"KV cache: .*")
PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\ndef walk_files(root):\n",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "def binary_search(xs, target):\n    lo, hi = 0, len(xs) - 1\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "def read_json(path):\n    with open(path) as f:\n",
    "# Merge two sorted lists into one sorted list\ndef merge(a, b):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
]
STOPS = [["\n\n"], ["return"], ["\n", ":"], [")"]]


@dataclass
class Sample:
    requests: int
    rss_mib: float
    delta_mib: float | None = None  # vs the RSS after the warm-up
    delta_pct: float | None = None


@dataclass
class Report:
    kv_line: str
    num_requests: int
    concurrency: int
    seconds: float
    outcomes: dict[str, int]
    slowest_seconds: float
    slowest_request: str
    samples: list[Sample] = field(default_factory=list)
    idle_rss_mib: float = 0.0
    baseline_mib: float = 0.0
    max_drift_pct: float = 0.0
    final_gauges: dict[str, float] = field(default_factory=dict)
    flat: bool = False


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


# ---- the server process ---------------------------------------------------------------------------------


def start_server(args: argparse.Namespace, port: int, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "server", "serve", "--port", str(port), "--kv-cache-memory-gb",
           str(args.kv_cache_memory_gb), "--log-stats-interval", "0"]
    if args.model:
        cmd += ["--model", args.model]
    if args.draft_model:
        cmd += ["--draft-model", args.draft_model]
    cmd += args.server_args
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    print("$", " ".join(cmd), flush=True)
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_ready(proc: subprocess.Popen, url: str, log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited with {proc.returncode} before it was ready:\n{log_path.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    sys.exit(f"the server was not ready in {timeout:.0f}s:\n{log_path.read_text()}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def gauges(url: str) -> dict[str, float]:
    """running / waiting / KV usage from /metrics (summed over label sets)."""
    names = {"running": "specd:num_requests_running", "waiting": "specd:num_requests_waiting",
             "kv_usage": "specd:kv_cache_usage_perc"}
    text = httpx.get(url + "/metrics", timeout=10).text
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        for key, name in names.items():
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


def wait_idle(url: str, timeout: float = 15.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        g = gauges(url)
        if not any(g.values()) or time.monotonic() > deadline:
            return g
        time.sleep(0.1)


# ---- the traffic ------------------------------------------------------------------------------------------


def plan(num: int, model: str, seed: int, chat_fraction: float) -> list[tuple[str, dict, int | None]]:
    """(path, body, drop_after) per request; drop_after: close a stream after that many events."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        prompt = "".join(rng.choice(PROMPTS) for _ in range(rng.choice((1, 1, 2, 3, 5))))
        body: dict = {"model": model, "max_tokens": rng.randint(8, 32), "temperature": 0.0}
        if rng.random() < 0.3:
            body.update(temperature=0.8, top_p=0.95)
            if rng.random() < 0.5:
                body["seed"] = rng.randrange(2**31)
        if rng.random() < 0.2:
            body["stop"] = rng.choice(STOPS)
        if rng.random() < 0.1:
            body["n"] = 2
        stream = rng.random() < 0.5
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        drop_after = rng.randint(1, 3) if stream and rng.random() < 0.1 else None
        if rng.random() < chat_fraction:
            body["messages"] = [{"role": "user", "content": prompt}]
            out.append(("/v1/chat/completions", body, drop_after))
        else:
            body["prompt"] = prompt
            out.append(("/v1/completions", body, drop_after))
    return out


async def sse_data(resp: httpx.Response) -> AsyncIterator[str]:
    """The ``data:`` payloads of an event stream. Lines end at CR or LF only, as SSE defines them: httpx's
    aiter_lines() also splits at U+0085, U+2028 and U+2029, which JSON may carry unescaped in generated text."""
    buffer = b""
    async for chunk in resp.aiter_bytes():
        *lines, buffer = (buffer + chunk).replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].removeprefix(b" ").decode()


async def send(http: httpx.AsyncClient, path: str, body: dict, drop_after: int | None) -> str:
    """One request; returns its outcome: ok, dropped, http_<status>, stream_error or a transport error."""
    try:
        if not body.get("stream"):
            resp = await http.post(path, json=body)
            return "ok" if resp.status_code == 200 else f"http_{resp.status_code}"
        async with http.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return f"http_{resp.status_code}"
            events = 0
            async for data in sse_data(resp):
                events += 1
                if data == "[DONE]":
                    return "ok"
                if "error" in json.loads(data):
                    return "stream_error"
                if drop_after is not None and events >= drop_after:
                    return "dropped"  # leaving the block closes the connection mid-stream
            return "ok"
    except httpx.HTTPError as exc:
        return type(exc).__name__


def describe(path: str, body: dict, drop_after: int | None) -> str:
    keys = ("max_tokens", "n", "stop", "temperature", "seed", "stream")
    shape = ", ".join(f"{k}={body[k]!r}" for k in keys if k in body)
    dropped = f", dropped after {drop_after} events" if drop_after else ""
    return f"{path} ({shape}{dropped})"


async def drive(
    args: argparse.Namespace, url: str, pid: int, model: str
) -> tuple[list[Sample], Counter, float, tuple[float, str]]:
    work = plan(args.num_requests, model, args.seed, args.chat_fraction)
    samples = [Sample(0, rss_mib(pid))]
    outcomes: Counter = Counter()
    slowest = (0.0, "")
    done = 0
    queue: asyncio.Queue[tuple[str, dict, int | None]] = asyncio.Queue()
    for w in work:
        queue.put_nowait(w)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:

        async def worker() -> None:
            nonlocal done, slowest
            while not queue.empty():
                path, body, drop_after = queue.get_nowait()
                t = time.perf_counter()
                outcome = await send(http, path, body, drop_after)
                outcomes[outcome] += 1
                if (took := time.perf_counter() - t) > slowest[0]:
                    slowest = (took, f"{describe(path, body, drop_after)}: {outcome}")
                done += 1
                if done % args.sample_every == 0 or done == args.num_requests:
                    samples.append(Sample(done, rss_mib(pid)))
                    print(f"  {done:5d} requests, RSS {samples[-1].rss_mib:7.1f} MiB", flush=True)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        seconds = time.perf_counter() - t0
    return samples, outcomes, seconds, slowest


# ---- main ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="target directory (default: the embedded default pair)")
    parser.add_argument("--draft-model", help="draft directory (with --model)")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=0.25, help="KV budget in GiB (default 0.25)")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=100, help="requests before the baseline RSS (default 100)")
    parser.add_argument("--sample-every", type=int, default=50, help="requests between RSS samples (default 50)")
    parser.add_argument("--max-drift-pct", type=float, default=5.0, help="the verdict's limit (default 5)")
    parser.add_argument(
        "--chat-fraction", type=float, default=0.1,
        help="share of /v1/chat/completions requests (default 0.1; 0 for a model without a chat template)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=0, help="default: a free port")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--log-file", help="keep the server's log here (default: a temporary file)")
    parser.add_argument("--json-out", help="write the samples and the verdict as JSON")
    parser.add_argument("server_args", nargs="*", help="after --: more `specd serve` flags")
    args = parser.parse_args(argv)
    if args.warmup % args.sample_every or not 0 < args.warmup < args.num_requests:
        parser.error("--warmup must be a multiple of --sample-every and below --num-requests")

    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(args.log_file) if args.log_file else Path(tmp) / "server.log"
        proc = start_server(args, port, log_path)
        try:
            t0 = time.perf_counter()
            wait_ready(proc, url, log_path, args.ready_timeout)
            log = log_path.read_text()
            kv = KV_LINE.search(log)
            kv_line = kv.group(0) if kv else "(no KV cache line in the start-up log)"
            print(f"ready in {time.perf_counter() - t0:.1f}s (pid {proc.pid})")
            print(f"start-up: --kv-cache-memory-gb {args.kv_cache_memory_gb:g} -> {kv_line}", flush=True)
            model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            print(f"{args.num_requests} requests to {model!r}, concurrency {args.concurrency}", flush=True)
            samples, outcomes, seconds, slowest = asyncio.run(drive(args, url, proc.pid, model))
            final = wait_idle(url)
            idle_rss = rss_mib(proc.pid)
        finally:
            stop_server(proc)

    base = next(s.rss_mib for s in samples if s.requests == args.warmup)
    for s in samples:
        s.delta_mib = s.rss_mib - base
        s.delta_pct = 100 * s.delta_mib / base
    after = [s for s in samples if s.requests >= args.warmup]
    after_pcts = [abs(s.delta_pct or 0.0) for s in after] + [abs(100 * (idle_rss - base) / base)]
    report = Report(
        kv_line=kv_line, num_requests=args.num_requests, concurrency=args.concurrency, seconds=seconds,
        outcomes=dict(outcomes), slowest_seconds=slowest[0], slowest_request=slowest[1], samples=samples,
        idle_rss_mib=idle_rss, baseline_mib=base,
        max_drift_pct=max(after_pcts), final_gauges=final,
    )
    report.flat = report.max_drift_pct <= args.max_drift_pct and not any(final.values())

    print()
    print(f"| requests | RSS MiB | change vs warm-up ({args.warmup}) |")
    print("|---:|---:|---:|")
    for s in samples:
        mark = "" if s.requests >= args.warmup else " (warm-up)"
        print(f"| {s.requests} | {s.rss_mib:.1f} | {s.delta_mib:+.1f} MiB ({s.delta_pct:+.2f}%){mark} |")
    idle_pct = 100 * (idle_rss - base) / base
    print(f"| idle after the run | {idle_rss:.1f} | {idle_rss - base:+.1f} MiB ({idle_pct:+.2f}%) |")
    print()
    print(f"outcomes: {dict(sorted(outcomes.items()))}; {seconds:.1f}s, {args.num_requests / seconds:.1f} req/s")
    print(f"slowest request: {slowest[0]:.2f}s, {slowest[1]}")
    failed = {k: v for k, v in outcomes.items() if k not in ("ok", "dropped")}
    if failed:
        print(f"warning: {sum(failed.values())} request(s) did not complete: {failed}")
    print(f"at the end: running {final['running']:g}, waiting {final['waiting']:g}, KV usage {final['kv_usage']:g}")
    verdict = "FLAT" if report.flat else "NOT FLAT"
    print(f"verdict: {verdict}: RSS {samples[0].rss_mib:.1f} MiB at start, {base:.1f} MiB after warm-up, "
          f"{samples[-1].rss_mib:.1f} MiB after {args.num_requests} requests; max drift after warm-up "
          f"{report.max_drift_pct:.2f}% (limit {args.max_drift_pct:g}%)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 0 if report.flat else 1


if __name__ == "__main__":
    sys.exit(main())
