"""Timing primitives: interleaved medians and single forwards of the engine's and transformers' models."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from engine.worker.forward_batch import ForwardBatch
from engine.worker.model_runner import ModelRunner


def interleaved_medians(fns: list[Callable[[], None]], reps: int) -> list[float]:
    """Median wall time of each function, calling them round-robin so load changes hit all alike."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()  # warm
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def engine_forward_fn(runner: ModelRunner, batch: int, ctx: int, block_size: int, n: int = 1) -> Callable[[], None]:
    """One forward of ``n`` new tokens per sequence (logits for all, as when verifying n - 1 drafts)
    at positions ``ctx...``, on blocks no live sequence owns (the engine's own calibration does the
    same; what it writes there is garbage by design)."""
    nb = -(-(ctx + n) // block_size)
    assert runner.cache is not None and batch * nb <= runner.cache.num_blocks, "KV cache too small"
    fb = ForwardBatch(
        token_ids=[[5] * n] * batch,
        starts=[ctx] * batch,
        block_tables=[list(range(i * nb, (i + 1) * nb)) for i in range(batch)],
        logits_rows=[n] * batch,
    )

    def fn() -> None:
        runner.forward(fb)
        runner.synchronize()

    return fn


def hf_forward_fn(model: torch.nn.Module, ctx_ids: torch.Tensor) -> Callable[[], None]:
    """One cached single-token forward at context length ctx_ids.shape[1], cache cropped back after."""
    with torch.inference_mode():
        cache = model(input_ids=ctx_ids, use_cache=True).past_key_values
    ctx = ctx_ids.shape[1]
    nxt = ctx_ids[:, -1:]

    def fn() -> None:
        with torch.inference_mode():
            model(input_ids=nxt, past_key_values=cache, use_cache=True)
        cache.crop(ctx - cache.get_seq_length())  # a negative count: drop the token just added

    return fn
