"""Seed an adaptive policy's cost model with a few timed forwards at start-up, so the first requests
already get a sensible k."""

from __future__ import annotations

import logging
import time

from engine.speculative.adaptive import AdaptivePolicy
from engine.worker.forward_batch import ForwardBatch
from engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def calibrate(policy: AdaptivePolicy, target: ModelRunner, draft: ModelRunner | None, block_size: int,
              name: str) -> None:
    """Writes into blocks nobody owns yet; their contents are garbage-by-design. ``draft`` is the
    runner whose forwards a draft costs, None for prompt lookup."""
    k_max = policy.k_max
    # The layouts of the steps being priced: a decode and a full verify, after one cached position (a one-token
    # context is a shape no step has, so a compiled runner would time it eagerly, at 2-3x the cost). A third,
    # longer size is a prefill chunk, which steps of speculation never run.
    sizes = (1, k_max + 1)
    blocks = list(range(-(-(1 + max(sizes)) // block_size)))
    for runner, cost in ((target, policy.target_cost), (draft, policy.draft_cost)):
        if runner is None:
            continue
        for n in sizes:
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                runner.forward(ForwardBatch([[0] * n], [1], [blocks], [n]))
                runner.synchronize()
                best = min(best, time.perf_counter() - t0)
            cost.observe(n, best)
    if draft is None:
        # n-gram lookup: a draft costs a Python lookup, not a forward; a small constant will do.
        policy.draft_cost.observe(1, 2e-5)
    logger.info("adaptive k (%s): cost ratio c at batch 1 = %.3f", name, policy.cost_ratio(1))
