"""Two specd replicas behind vllm-router (the PyPI package deploy/router runs) on loopback: its cache-aware
policy sends each document's requests to the replica that cached it, round-robin does not, and both spread
the requests over the replicas."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from server.config import ServerConfig
from tests.server.conftest import LiveServer, tiny_engine
from tests.tiny_models import CORPUS

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from router import Router, cached_share, schedule, send, served, with_cache  # noqa: E402

MODEL = "tiny-llama"
DOCUMENTS, REPEATS, CONCURRENCY = 24, 4, 8


def documents(tag: str) -> list[str]:
    """Distinct texts of several KV blocks each, distinct from their first characters (so neither the router's
    prefix tree nor a prefix cache sees two as one); ``tag`` makes each policy's set its own."""
    out = []
    for i in range(DOCUMENTS):
        lines = [line for text in CORPUS for line in text.splitlines()]
        random.Random(f"{tag}{i}").shuffle(lines)
        out.append(f"{i} {tag}\n" + "\n".join(lines[:8]))
    return out


@pytest.fixture(scope="module")
def replicas(model_sets) -> Iterator[list[LiveServer]]:
    target = model_sets["llama"].target
    started = [LiveServer(ServerConfig(model=str(target), served_model_name=MODEL), tiny_engine(target))
               for _ in range(2)]
    yield started
    for live in started:
        live.stop()


def through(replicas: list[LiveServer], policy: str | None, tag: str, tmp_path: Path) -> tuple[list, list[float]]:
    """The workload through a router of ``policy`` over both replicas (None: straight to the first alone); the
    outcomes, and each replica's share of the requests."""
    before = [served(r.url) for r in replicas]
    router = Router([r.url for r in replicas], policy, tmp_path / f"{policy}.log") if policy else None
    try:
        url = router.url if router else replicas[0].url
        outcomes = send(url, MODEL, documents(tag), schedule(DOCUMENTS, REPEATS, seed=1), CONCURRENCY)
    finally:
        if router:
            router.stop()
    counts = [served(r.url) - b for r, b in zip(replicas, before)]
    return outcomes, [c / sum(counts) for c in counts]


def test_cache_aware_routing_keeps_what_one_replica_would_cache_and_round_robin_does_not(replicas, tmp_path):
    alone, _ = through(replicas, None, "alone", tmp_path)
    aware, aware_shares = through(replicas, "cache_aware", "aware", tmp_path)
    robin, robin_shares = through(replicas, "round_robin", "robin", tmp_path)
    assert len(alone) == len(aware) == len(robin) == DOCUMENTS * REPEATS
    # One replica sees every ask: all but each document's first can find it cached ((R - 1) / R), fewer where
    # two asks of one document run at once. Cache-aware routing keeps a document on one replica; round-robin
    # sends its asks to either, so an ask finds it only where an earlier one happened to land on the same one.
    assert with_cache(aware) >= 0.6, f"requests with cached tokens through cache_aware: {with_cache(aware):.2f}"
    assert cached_share(aware) >= 0.8 * cached_share(alone), (cached_share(aware), cached_share(alone))
    assert with_cache(robin) <= with_cache(aware) - 0.1, (with_cache(robin), with_cache(aware))
    for shares in (aware_shares, robin_shares):
        assert min(shares) >= 1 / 3, f"a replica served {min(shares):.0%} of the requests"
