#!/usr/bin/env python
"""What the Prometheus metrics and the stats log cost the decode loop.

    python benchmarks/metrics_overhead.py                 # both parts below
    python benchmarks/metrics_overhead.py --no-engine     # part 1 only (seconds)

1. The observers alone: everything the engine's worker thread does per step for observability
   (Metrics.observe_step, StatsLog.observe_step, and the queue-time scan of AsyncEngine) timed over
   many calls on realistic StepStats (batch 1, 8 and 64, k = 4, half the drafts accepted), and the
   event-loop side per delivered delta (RequestTracker.on_output).
2. A real decode loop: the engine benchmark's pair (a random Llama, hidden 512, 8 layers, and its
   1-layer truncated draft; see benchmarks/engine_bench/pair.py) decoding a batch with k = 4, where
   after every engine.step() the observers are called exactly as the worker thread calls them. The
   time inside the observer calls is reported as a share of the loop.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import RequestOutput, StepStats  # noqa: E402
from engine.types.stats import SourceStepStats  # noqa: E402
from server.async_engine import AsyncEngine  # noqa: E402
from server.metrics import Metrics  # noqa: E402
from server.request_stats import RequestInfo, RequestTracking  # noqa: E402
from server.stats_log import StatsLog  # noqa: E402


def realistic_step(batch: int, k: int, rng: random.Random) -> StepStats:
    accepted = [min(k, int(rng.expovariate(0.5))) for _ in range(batch)]
    per_pos = tuple(sum(a > j for a in accepted) for j in range(k))
    return StepStats(
        num_scheduled=batch, num_prompt_tokens=0, num_generated_tokens=sum(accepted) + batch, num_drafts=batch,
        num_draft_tokens=k * batch, num_accepted_tokens=sum(accepted), accepted_per_position=per_pos,
        accepted_lengths=tuple(a + 1 for a in accepted), num_decoding=batch, mean_k=float(k), num_preempted=0,
        num_running=batch,
        num_waiting=0, kv_usage=0.4, draft_seconds=0.002, target_seconds=0.01, step_seconds=0.013,
        by_source=(SourceStepStats("draft_model", batch, k * batch, sum(accepted), per_pos),),
    )


def time_per_call(fn, n: int) -> float:
    """Median over 5 runs of the mean seconds per call."""
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n)
    return sorted(runs)[2]


def worker_side(metrics: Metrics, stats_log: StatsLog, fake_async: SimpleNamespace):
    """One step's observability work in the worker thread."""

    def observe(step: StepStats, outputs: list[RequestOutput], unscheduled: dict[str, float]) -> None:
        queue_seconds = AsyncEngine._first_scheduled(fake_async, unscheduled, 0.0)  # noqa: SLF001
        for o in (metrics, stats_log):
            o.observe_step(step, outputs)
            if queue_seconds:
                o.observe_scheduled(queue_seconds)

    return observe


def per_step_call(batch: int, rng: random.Random) -> Callable[[], None]:
    metrics, stats_log = Metrics("bench"), StatsLog(10.0)
    waiting = {f"w{i}": SimpleNamespace(num_computed=0) for i in range(batch)}  # as many still waiting
    fake_async = SimpleNamespace(engine=SimpleNamespace(seqs=waiting))
    unscheduled = dict.fromkeys(waiting, 0.0)
    observe = worker_side(metrics, stats_log, fake_async)
    steps = itertools.cycle([realistic_step(batch, 4, rng) for _ in range(64)])
    return lambda: observe(next(steps), [], unscheduled)


def observers_alone(n: int) -> None:
    print("1. observers alone (mean per call, median of 5 runs)")
    rng = random.Random(0)
    for batch in (1, 8, 64):
        secs = time_per_call(per_step_call(batch, rng), n)
        print(f"   worker thread, per step, batch {batch:>2}, k 4 ({batch} waiting): {secs * 1e6:6.1f} us")
    metrics = Metrics("bench")
    tracking = RequestTracking(metrics)
    tracker = tracking.start(RequestInfo("r", time.monotonic(), 10), ["r-0"])
    out = RequestOutput("r-0", [5, 6, 7], "abc", [], False, None, None, 10, 3, 4, 2)
    secs = time_per_call(lambda: tracker.on_output(out), n)
    print(f"   event loop, per delivered delta of 3 tokens (RequestTracker.on_output): {secs * 1e6:6.1f} us")


def decode_loop(batch: int, max_tokens: int) -> None:
    from engine_bench.pair import build_pair, make_prompts  # benchmarks/ is on sys.path when run as a script

    from engine import EngineConfig, LLMEngine, SamplingParams

    print(f"2. decode loop: benchmark pair, batch {batch}, k 4, {max_tokens} new tokens per sequence")
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = build_pair(Path(tmp), quick=False, draft_layers=1, embed_std=3.0, seed=0)
        engine = LLMEngine(EngineConfig(
            model=str(target), draft_model=str(draft), speculative_method="draft_model", num_speculative_tokens=4,
            dtype="float32", device="cpu",
        ))
        prompts = make_prompts(target, batch, 320, 24)
        metrics, stats_log = Metrics("bench"), StatsLog(10.0)
        fake_async = SimpleNamespace(engine=engine)
        observe = worker_side(metrics, stats_log, fake_async)
        for warm in (True, False):
            params = SamplingParams(max_tokens=8 if warm else max_tokens, temperature=0.0, ignore_eos=True)
            unscheduled = {}
            for i, p in enumerate(prompts):
                engine.add_request(f"{warm}-{i}", p, params)
                unscheduled[f"{warm}-{i}"] = time.monotonic()
            observe_s: list[float] = []
            t_loop = time.perf_counter()
            while engine.has_unfinished():
                outputs = engine.step()
                t0 = time.perf_counter()
                observe(engine.last_step, outputs, unscheduled)
                observe_s.append(time.perf_counter() - t0)
            loop_s = time.perf_counter() - t_loop
        steps = len(observe_s)
        print(f"   {steps} steps, {loop_s / steps * 1e3:.2f} ms per step; observers per step: "
              f"mean {sum(observe_s) / steps * 1e6:.1f} us, median {statistics.median(observe_s) * 1e6:.1f} us, "
              f"max {max(observe_s) * 1e6:.0f} us; in all {sum(observe_s) / loop_s:.3%} of the loop")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=20000, help="calls per timing run in part 1")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decode batches in part 2")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--no-engine", action="store_true", help="skip part 2")
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    observers_alone(args.calls)
    if not args.no_engine:
        for batch in args.batch:
            decode_loop(batch, args.max_tokens)


if __name__ == "__main__":
    main()
