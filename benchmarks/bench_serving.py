#!/usr/bin/env python
"""Online serving benchmark for any OpenAI-compatible server (specd, vLLM, ...), in the manner of
vLLM's benchmark_serving: stream requests at a fixed rate (Poisson arrivals) or a fixed concurrency
and report throughput and latency.

    python -m server serve --model DIR --draft-model DIR --port 8000 &
    python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 --num-prompts 64 --request-rate 4
    python benchmarks/bench_serving.py --max-concurrency 8 --dataset prompts.jsonl --tokenizer DIR --json-out r.json

Metrics, per request (streamed, so the first token's arrival is observable):
  TTFT  time from sending the request to the first chunk with text;
  TPOT  (latency - TTFT) / (output tokens - 1): the mean time per output token after the first;
  ITL   the gaps between successive chunks with text. A speculative server may send several tokens
        in one chunk (a verify step accepts a run of drafts), so ITL is per chunk, not per token;
  E2EL  the whole request.
Output tokens are recounted from the text with --tokenizer when given, else taken from
usage.completion_tokens (stream_options.include_usage); the JSON keeps both. (A random model's
text does not re-tokenize to the tokens that made it, so with tiny test models the two differ.)
The acceptance rate (accepted / drafted tokens) comes from specd's usage extension fields when
present, else from the server's Prometheus counters scraped before and after the run (specd:* or
vllm:* spec-decode counters).

Dataset (--dataset): JSONL, one object per line with "prompt" (completions) or "messages" (chat),
and optionally "max_tokens". Without it, a built-in set of code-completion prompts is used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

BUILTIN_PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "def quicksort(items):\n",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "import os\n\ndef walk_files(root):\n",
    "def binary_search(xs, target):\n    lo, hi = 0, len(xs) - 1\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "    def __add__(self, other):\n",
    "def read_json(path):\n    with open(path) as f:\n",
    "async def fetch(session, url):\n",
    "def is_prime(n):\n    if n < 2:\n        return False\n",
    "# Merge two sorted lists into one sorted list\ndef merge(a, b):\n",
    "def flatten(nested):\n    out = []\n",
    "import re\n\nEMAIL = re.compile(",
    "def word_count(text):\n    counts = {}\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def matrix_multiply(a, b):\n",
    "def parse_args():\n    parser = argparse.ArgumentParser(",
    "SELECT name, COUNT(*) FROM orders\n",
    "def gcd(a, b):\n    while b:\n",
    "function debounce(fn, ms) {\n",
    "#include <stdio.h>\n\nint main(void) {\n",
    "def levenshtein(a, b):\n",
    "class Node:\n    def __init__(self, value, next=None):\n",
    "def transpose(matrix):\n    return ",
]


@dataclass
class Request:
    prompt: str | None = None
    messages: list | None = None
    max_tokens: int | None = None


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""
    output_tokens: int = 0
    usage: dict = field(default_factory=dict)


def load_requests(args: argparse.Namespace) -> list[Request]:
    if args.dataset:
        with open(args.dataset) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        reqs = [Request(r.get("prompt"), r.get("messages"), r.get("max_tokens")) for r in rows]
    else:
        reqs = [Request(prompt=p) for p in BUILTIN_PROMPTS]
    if args.endpoint == "chat":
        for r in reqs:
            if r.messages is None:
                r.messages, r.prompt = [{"role": "user", "content": r.prompt}], None
    rng = random.Random(args.seed)
    out = [reqs[i % len(reqs)] for i in range(args.num_prompts)]
    rng.shuffle(out)
    return out


def body_for(req: Request, args: argparse.Namespace) -> dict:
    body = {
        "model": args.model,
        "max_tokens": req.max_tokens or args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True  # specd and vLLM extension
    if args.endpoint == "chat":
        body["messages"] = req.messages
    else:
        body["prompt"] = req.prompt
    return body


async def send(client: httpx.AsyncClient, url: str, body: dict, chat: bool) -> Result:
    res = Result()
    t0 = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message"))
                    return res
                if chunk.get("usage"):
                    res.usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if piece:
                        now = time.perf_counter()
                        if not res.text:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
                        res.text += piece
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.latency = time.perf_counter() - t0
    res.ok = True
    return res


async def scrape(client: httpx.AsyncClient, base: str) -> dict[str, float]:
    """Spec-decode counters from /metrics, summed over label sets; {} if unavailable."""
    try:
        text = (await client.get(base + "/metrics")).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for name in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
        pattern = re.compile(rf"^(?:specd|vllm):{name}_total(?:{{[^}}]*}})? ([0-9.eE+-]+)$", re.M)
        values = [float(v) for v in pattern.findall(text)]
        if values:
            out[name] = sum(values)
    return out


async def run(args: argparse.Namespace, reqs: list[Request]) -> tuple[list[Result], float, dict, dict]:
    base = args.base_url.rstrip("/")
    url = base + ("/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=args.timeout, headers=headers, limits=limits) as client:
        if args.model is None:
            args.model = (await client.get(base + "/v1/models")).json()["data"][0]["id"]
        chat = args.endpoint == "chat"
        for req in reqs[: args.warmup]:
            warm = await send(client, url, body_for(req, args), chat)
            if not warm.ok:
                sys.exit(f"warm-up request failed: {warm.error}")
        before = await scrape(client, base)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        rng = random.Random(args.seed)

        async def one(req: Request) -> Result:
            if sem is None:
                return await send(client, url, body_for(req, args), chat)
            async with sem:
                return await send(client, url, body_for(req, args), chat)

        tasks = []
        t0 = time.perf_counter()
        for req in reqs:
            tasks.append(asyncio.create_task(one(req)))
            if args.request_rate != math.inf:
                # Poisson arrivals (burstiness 1); other burstiness: gamma intervals of the same mean.
                theta = 1.0 / (args.request_rate * args.burstiness)
                await asyncio.sleep(rng.gammavariate(args.burstiness, theta))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        after = await scrape(client, base)
    return results, duration, before, after


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(args: argparse.Namespace, results: list[Result], duration: float, before: dict, after: dict) -> dict:
    tok = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    ok = [r for r in results if r.ok]
    for r in ok:
        if tok is not None:
            r.output_tokens = len(tok.encode(r.text, add_special_tokens=False))
        else:
            r.output_tokens = int(r.usage.get("completion_tokens", 0))
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(int(r.usage.get("prompt_tokens", 0)) for r in ok)
    ttft = [r.ttft * 1000 for r in ok if r.text]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) * 1000 for r in ok if r.output_tokens > 1]
    itl = [x * 1000 for r in ok for x in r.itl]
    e2el = [r.latency * 1000 for r in ok]
    drafted = sum(int(r.usage.get("spec_draft_tokens", 0)) for r in ok)
    accepted = sum(int(r.usage.get("spec_accepted_tokens", 0)) for r in ok)
    source = "usage"
    if not any("spec_draft_tokens" in r.usage for r in ok):
        drafted = after.get("spec_decode_num_draft_tokens", 0) - before.get("spec_decode_num_draft_tokens", 0)
        accepted = after.get("spec_decode_num_accepted_tokens", 0) - before.get("spec_decode_num_accepted_tokens", 0)
        source = "/metrics" if after else "unavailable"
    summary = {
        "base_url": args.base_url, "model": args.model, "endpoint": args.endpoint,
        "request_rate": "inf" if args.request_rate == math.inf else args.request_rate,
        "max_concurrency": args.max_concurrency, "num_prompts": len(results),
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + prompt_tokens) / duration,
        "total_output_tokens": out_tokens, "total_prompt_tokens": prompt_tokens,
        "usage_completion_tokens": sum(int(r.usage.get("completion_tokens", 0)) for r in ok),
        "output_tokens_counted_by": "tokenizer" if tok is not None else "usage.completion_tokens",
        "spec_draft_tokens": drafted, "spec_accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None, "acceptance_source": source,
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    for name, xs in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl), ("e2el_ms", e2el)):
        summary[f"mean_{name}"] = statistics.fmean(xs) if xs else float("nan")
        summary[f"p50_{name}"] = pct(xs, 50)
        summary[f"p99_{name}"] = pct(xs, 99)
    return summary


def print_table(s: dict) -> None:
    rows = [
        ("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
        ("Benchmark duration (s)", s["duration_s"]), ("Request rate (req/s, configured)", s["request_rate"]),
        ("Max concurrency", s["max_concurrency"] or "unlimited"),
        ("Total prompt tokens", s["total_prompt_tokens"]),
        (f"Total output tokens ({s['output_tokens_counted_by']})", s["total_output_tokens"]),
        ("Request throughput (req/s)", s["request_throughput"]),
        ("Output token throughput (tok/s)", s["output_throughput"]),
        ("Total token throughput (tok/s)", s["total_token_throughput"]),
    ]
    for name, label in (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)"),
                        ("e2el_ms", "E2E latency (ms)")):
        rows += [(f"Mean {label}", s[f"mean_{name}"]), (f"P50 {label}", s[f"p50_{name}"]),
                 (f"P99 {label}", s[f"p99_{name}"])]
    rate = s["acceptance_rate"]
    rows += [
        (f"Draft tokens ({s['acceptance_source']})", s["spec_draft_tokens"]),
        ("Accepted draft tokens", s["spec_accepted_tokens"]),
        ("Acceptance rate", "n/a" if rate is None else f"{rate:.3f}"),
    ]
    width = max(len(k) for k, _ in rows) + 2
    print("=" * (width + 14))
    print(f" Serving benchmark: {s['model']} at {s['base_url']} ({s['endpoint']})")
    print("-" * (width + 14))
    for k, v in rows:
        print(f"{k:<{width}}{v:>12.2f}" if isinstance(v, float) else f"{k:<{width}}{v!s:>12}")
    print("=" * (width + 14))
    for err in s["errors"]:
        print("error:", err)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first id from /v1/models")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", default=None, help="JSONL with prompt or messages (and max_tokens) per line")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens (specd/vLLM extension)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (Poisson); inf sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 is Poisson")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--tokenizer", default=None, help="recount output tokens from the text with this tokenizer")
    p.add_argument("--warmup", type=int, default=1, help="requests sent (and not measured) first")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="write the summary here as JSON")
    p.add_argument("--save-requests", action="store_true", help="include per-request results in the JSON")
    args = p.parse_args()
    reqs = load_requests(args)
    results, duration, before, after = asyncio.run(run(args, reqs))
    summary = summarize(args, results, duration, before, after)
    print_table(summary)
    if args.json_out:
        if args.save_requests:
            summary["requests"] = [asdict(r) for r in results]
        clean = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in summary.items()}
        with open(args.json_out, "w") as f:
            json.dump(clean, f, indent=2)
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
