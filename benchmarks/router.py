#!/usr/bin/env python
"""Prefix caching across replicas: specd replicas behind vllm-router's cache-aware policy, against its
round-robin and against one replica alone.

    python benchmarks/router.py                  # ~4 min on 2 cores
    python benchmarks/router.py --rounds 1       # a quick look

A workload of repeated prefixes: D documents (held-out code the embedded pair never saw, ~200 tokens each),
each asked R times with a different question appended, in a shuffled order, sent at C concurrent requests
(one connection per client thread) to /v1/completions, 16 new tokens each. A replica's prefix cache serves
a request's document when an earlier request with that document ran there; one replica sees every request,
so it bounds what routing can keep: (R - 1) / R of the requests find their document, less where two asks
of one document run at once. Every configuration starts fresh replicas (`specd serve --compile off`, the
embedded pair, no speculation: caching is what is measured), so nothing cached carries over.

Reported per configuration: the share of prompt tokens served from a prefix cache (usage's
prompt_tokens_details.cached_tokens over prompt_tokens), the share of requests with any, each replica's share
of the requests (its specd:request_success_total), and the wall time. Writes benchmarks/results/router.json
and benchmarks/results/router.png.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
for p in (ROOT, HERE):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from peer_bench.systems import free_port  # noqa: E402

QUESTIONS = ("\n# what does this return?\n", "\n# rewrite it shorter\n", "\n# add a docstring\n",
             "\n# list its arguments\n", "\n# where can it fail?\n", "\n# name it better\n")


def router_binary() -> str:
    """vllm-router, installed by the dev extra beside this interpreter (or on PATH)."""
    local = Path(sys.executable).with_name("vllm-router")
    found = str(local) if local.exists() else shutil.which("vllm-router")
    if not found:
        raise SystemExit("vllm-router is not installed: pip install -e '.[dev]' (or pip install vllm-router)")
    return found


class Served:
    """A server process on a free loopback port (``cmd`` gets the port), logging to ``log``, until ``stop``."""

    def __init__(self, cmd: Callable[[int], list[str]], log: Path, what: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.what = what
        self.log = open(log, "w")  # noqa: SIM115
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(cmd(self.port), cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 300) -> None:
        """Until /health answers 200; an exit or the timeout stops it and raises."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.what} did not start: see {self.log.name}")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class Router(Served):
    """vllm-router in front of ``workers``, ready once constructed."""

    def __init__(self, workers: Sequence[str], policy: str, log: Path) -> None:
        # Its metrics exporter listens on a port of its own (29000 by default): one per router.
        super().__init__(lambda port: [router_binary(), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                                       "--worker-urls", *workers, "--prometheus-host", "127.0.0.1",
                                       "--prometheus-port", str(free_port())], log, "vllm-router")
        self.wait_ready(60)


@dataclass(frozen=True)
class Outcome:
    document: int
    prompt_tokens: int
    cached_tokens: int


def schedule(documents: int, repeats: int, seed: int) -> list[tuple[int, int]]:
    """(document, question) pairs: every document asked ``repeats`` times, in a shuffled order."""
    pairs = [(d, q % len(QUESTIONS)) for d in range(documents) for q in range(repeats)]
    random.Random(seed).shuffle(pairs)
    return pairs


def send(url: str, model: str, docs: Sequence[str], pairs: Sequence[tuple[int, int]], concurrency: int,
         max_tokens: int = 16, api_key: str = "unused") -> list[Outcome]:
    """The pairs in order, ``concurrency`` at a time (one client and connection per thread)."""
    todo, out, lock, errors = list(pairs), [], threading.Lock(), []

    def worker() -> None:
        with httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {api_key}"}) as client:
            while True:
                with lock:
                    if not todo or errors:
                        return
                    d, q = todo.pop(0)
                r = client.post("/v1/completions", json={"model": model, "prompt": docs[d] + QUESTIONS[q],
                                                         "max_tokens": max_tokens, "temperature": 0.0})
                if r.status_code != 200:
                    errors.append(f"{r.status_code}: {r.text[:200]}")
                    return
                usage = r.json()["usage"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                with lock:
                    out.append(Outcome(d, usage["prompt_tokens"], cached))

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"a request failed: {errors[0]}")
    return out


def cached_share(outcomes: Sequence[Outcome]) -> float:
    return sum(o.cached_tokens for o in outcomes) / max(1, sum(o.prompt_tokens for o in outcomes))


def with_cache(outcomes: Sequence[Outcome]) -> float:
    return sum(o.cached_tokens > 0 for o in outcomes) / max(1, len(outcomes))


def served(url: str) -> float:
    """Requests a specd replica finished, from its /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("specd:request_success_total{"))


class Replica(Served):
    """``specd serve`` on the embedded pair: no compile, no speculation (caching is what is measured)."""

    def __init__(self, log: Path) -> None:
        super().__init__(lambda port: [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port",
                                       str(port), "--compile", "off", "--speculative-method", "none"], log, "replica")


def run_config(name: str, replicas: int, policy: str | None, docs: list[str], pairs: list[tuple[int, int]],
               concurrency: int, logs: Path) -> dict:
    started = [Replica(logs / f"{name}-replica{i}.log") for i in range(replicas)]
    router = None
    try:
        for r in started:
            r.wait_ready()
        model = httpx.get(started[0].url + "/v1/models", timeout=10).json()["data"][0]["id"]
        url = started[0].url
        if policy is not None:
            router = Router([r.url for r in started], policy, logs / f"{name}-router.log")
            url = router.url
        t0 = time.perf_counter()
        outcomes = send(url, model, docs, pairs, concurrency)
        seconds = time.perf_counter() - t0
        counts = [served(r.url) for r in started]
    finally:
        if router is not None:
            router.stop()
        for r in started:
            r.stop()
    return {"config": name, "requests": len(outcomes), "cached_share": cached_share(outcomes),
            "with_cache": with_cache(outcomes), "replica_shares": [c / max(1.0, sum(counts)) for c in counts],
            "seconds": seconds, "outcomes": [asdict(o) for o in outcomes]}


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = [s["config"] for s in summary]
    ax.bar(names, [s["cached_share"] for s in summary], color=["#888", "#2a7", "#c73"][: len(names)])
    ax.set_ylabel("prompt tokens from a prefix cache")
    ax.set_ylim(0, 1)
    for i, s in enumerate(summary):
        ax.text(i, s["cached_share"] + 0.02, f"{s['cached_share']:.2f}", ha="center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--documents", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--doc-tokens", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "router.json")
    args = ap.parse_args()

    from peer_bench.heldout import snippets
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ROOT / "models" / "default" / "target"))
    docs = snippets(tok, args.documents, args.doc_tokens)
    logs = Path(tempfile.mkdtemp(prefix="specd-router-"))
    configs = [("one replica", 1, None), ("cache_aware", args.replicas, "cache_aware"),
               ("round_robin", args.replicas, "round_robin")]
    runs = []
    print(f"logs in {logs}")
    for rnd in range(args.rounds):
        pairs = schedule(args.documents, args.repeats, seed=rnd)
        for name, n, policy in configs:
            row = run_config(name, n, policy, docs, pairs, args.concurrency, logs) | {"round": rnd}
            runs.append(row)
            shares = " / ".join(f"{s:.2f}" for s in row["replica_shares"])
            print(f"round {rnd + 1}/{args.rounds} {name:12s} cached {row['cached_share']:.3f}  "
                  f"requests with cache {row['with_cache']:.2f}  replica shares {shares}  {row['seconds']:.1f} s")
    summary = []
    for name, n, policy in configs:
        mine = [r for r in runs if r["config"] == name]
        summary.append({"config": name, "replicas": n, "policy": policy,
                        "cached_share": statistics.median(r["cached_share"] for r in mine),
                        "with_cache": statistics.median(r["with_cache"] for r in mine),
                        "min_replica_share": min(min(r["replica_shares"]) for r in mine)})
    alone = summary[0]["cached_share"]
    print(f"\n{args.documents} documents x {args.repeats} asks, {args.concurrency} concurrent, "
          f"{args.replicas} replicas, median of {args.rounds} rounds\n")
    print("| configuration | prompt tokens cached | requests with cache | vs one replica | least-loaded replica |")
    print("|---|---|---|---|---|")
    for s in summary:
        print(f"| {s['config']} | {s['cached_share']:.3f} | {s['with_cache']:.2f} | "
              f"{s['cached_share'] / alone:.2f}x | {s['min_replica_share']:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    router_version = importlib.metadata.version("vllm-router")
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                    "router": router_version, "summary": summary, "runs": runs}, indent=1) + "\n")
    plot(summary, args.out.with_suffix(".png"))
    print(f"\nwrote {args.out}, {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
