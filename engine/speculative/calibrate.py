"""Profile the step-cost model at start-up with a few timed forwards, so the first requests already get a
sensible plan; every later step corrects it (engine.speculative.step_cost)."""

from __future__ import annotations

import logging
import time

from engine.speculative.controller import GoodputController
from engine.speculative.eagle import EagleRunner
from engine.worker.forward_batch import ForwardBatch
from engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Host work per sequence before any step measured it (asking the lookups, a speculative step's bookkeeping):
# a guess of the right order on CPU and GPU hosts alike, which the first steps replace.
HOST_PRIOR_SECONDS = 3e-5


def _best_of(runner: ModelRunner | EagleRunner, batch: ForwardBatch, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.forward(batch)
        runner.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def calibrate(controller: GoodputController, target: ModelRunner, drafters: dict[str, ModelRunner | EagleRunner | None],
              block_size: int, max_tokens: int, num_blocks: int) -> None:
    """Writes into blocks nobody owns yet; their contents are garbage-by-design. ``drafters``: the runner
    behind each model drafter's forwards, by source name; ``max_tokens``: the most a step feeds."""
    k_max = controller.k_max
    # The sizes of the steps being priced: a decode, small and full verifies of one sequence, and batches' worth of
    # tokens; each after a short cached context (a one-token context is a shape no step has, so a compiled runner
    # would time it eagerly), the decode and the full verify after a longer one too (what context adds).
    verify = k_max + 1
    sizes = sorted({1, 2, 3, k_max // 2 + 1, verify, *(verify * m for m in (2, 4, 8, 16))})
    room = num_blocks * block_size  # a tiny cache (a test's) still gets a profile, of the sizes it holds
    short, long = block_size, min(16 * block_size, 256, room // 4)
    max_tokens = max(2, min(max_tokens, room // 2 - long))
    sizes = [n for n in sizes if n <= max_tokens]
    runs = [(n, short) for n in sizes] + [(n, long) for n in (1, verify) if n <= max_tokens]
    blocks = list(range(-(-(max(start + n for n, start in runs)) // block_size)))
    points = []
    for n, start in runs:
        seconds = _best_of(target, ForwardBatch([[0] * n], [start], [blocks], [n]))
        points.append((n, n * (start + n) / 1000.0, seconds))
    controller.cost.target.set_profile(points)
    for name, runner in drafters.items():
        if runner is None:
            continue
        for n in (1, verify):
            controller.cost.drafters[name].observe(n, _best_of(runner, ForwardBatch([[0] * n], [1], [blocks], [n])))
    for fit in (controller.cost.lookup, controller.cost.host, controller.cost.host_plain):
        fit.observe(1, HOST_PRIOR_SECONDS)
        fit.observe(8, 8 * HOST_PRIOR_SECONDS)
    logger.info("goodput controller: step cost model at start-up %s",
                ", ".join(f"{k} {1e3 * v:.3f} ms" for k, v in controller.cost.parameters().items()))
