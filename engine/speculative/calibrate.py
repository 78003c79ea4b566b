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
              block_size: int, max_tokens: int, num_blocks: int, max_seqs: int) -> None:
    """Writes into blocks nobody owns yet; their contents are garbage-by-design. ``drafters``: the runner
    behind each model drafter's forwards, by source name; ``max_tokens``: the most a step feeds."""
    k_max = controller.k_max
    # The layouts of the steps being priced: one sequence decoding or verifying 1, 2, k_max / 2 or k_max drafts,
    # 2 to 64 sequences each verifying k_max, 2 to 64 decoding (the layouts a compiled runner warmed up, so a
    # compiled runner is timed compiled); each after a short cached context, the decode and the full verify after
    # a longer one too (what context adds). The verifies reach the largest batch: a plan for 64 sequences priced
    # past the profile's end would follow its last segment, and a forward's cost is not that straight.
    verify = k_max + 1
    room = num_blocks * block_size  # a tiny cache (a test's) still gets a profile, of the sizes it holds
    short, long = block_size, min(16 * block_size, 256, room // 4)
    per_seq = -(-(short + verify) // block_size)
    runs = [(1, n, short) for n in sorted({1, 2, 3, k_max // 2 + 1, verify})]
    runs += [(b, verify, short) for b in (2, 4, 8, 16, 32, 64)
             if b <= max_seqs and b * verify <= max_tokens and b * per_seq <= num_blocks]
    runs += [(b, 1, short) for b in (2, 4, 8, 16, 32, 64) if b <= max_seqs and b * per_seq <= num_blocks]
    runs += [(1, n, long) for n in (1, verify) if -(-(long + n) // block_size) <= num_blocks]
    points = []
    for b, n, start in runs:
        per = -(-(start + n) // block_size)
        tables = [list(range(i * per, (i + 1) * per)) for i in range(b)]
        batch = ForwardBatch([[0] * n] * b, [start] * b, tables, [n] * b)
        points.append((b * n, b * n * (start + n) / 1000.0, _best_of(target, batch), n > 1))
    controller.cost.target.set_profile(points)
    for name, runner in drafters.items():
        if runner is None:
            continue
        for n in (1, verify):
            table = list(range(-(-(short + n) // block_size)))
            controller.cost.drafters[name].observe(n, _best_of(runner, ForwardBatch([[0] * n], [short], [table], [n])))
    for fit in (controller.cost.lookup, controller.cost.host.pooled, controller.cost.host_plain):
        fit.observe(1, HOST_PRIOR_SECONDS)
        fit.observe(8, 8 * HOST_PRIOR_SECONDS)
    logger.info("goodput controller: step cost model at start-up %s",
                ", ".join(f"{k} {1e3 * v:.3f} ms" for k, v in controller.cost.parameters().items()))
