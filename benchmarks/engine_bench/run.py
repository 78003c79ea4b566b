"""The measurement loop: warm-up, then per repeat the direct forward timings and the interleaved generate runs."""

from __future__ import annotations

import logging
import time

from . import BATCH
from .configs import Config, SpecdConfig

log = logging.getLogger(__name__)


def timed(cfg: Config, prompts: list[list[int]], batch: int, idx: list[int]) -> tuple[int, float]:
    """One recorded generate call of ``cfg`` on ``prompts`` (indices ``idx``). Returns (tokens, seconds)."""
    tally = cfg.tallies[batch]
    t0 = time.perf_counter()
    n = cfg.run(prompts, tally)
    dt = time.perf_counter() - t0
    tally.tokens += n
    tally.seconds += dt
    for i, toks in zip(idx, tally.last_outputs, strict=True):
        tally.outputs[i] = toks
    return n, dt


def benchmark(
    configs: list[Config], prompts: list[list[int]], n_b1: int, repeats: int, ctx: int, quick: bool,
    ngram_context: list[int],
) -> None:
    """Fill every configuration's tallies. ``ctx`` is the context length of the direct forward timings."""
    c_reps, verify_reps = (8, 6) if quick else (25, 15)
    log.info("warm-up: every configuration once at each batch size")
    for cfg in configs:
        for b in cfg.batches:
            cfg.run(prompts[:1] if b == 1 else prompts[:BATCH], None)
    for r in range(repeats):
        t_rep = time.perf_counter()
        # c first, interleaved target/draft forwards inside each measurement.
        for cfg in configs:
            if cfg.speculative:
                for b in cfg.batches:
                    c = cfg.measure_c(b, ctx, c_reps, ngram_context)
                    if c is not None:
                        cfg.tallies[b].cs.append(c)
            if isinstance(cfg, SpecdConfig) and cfg.key == "a":
                for b in cfg.batches:
                    cfg.tallies[b].verify.append(cfg.measure_verify(b, ctx, verify_reps))
        per_rep = {(cfg.key, b): [0, 0.0] for cfg in configs for b in cfg.batches}
        for p in range(n_b1):
            shift = (r * n_b1 + p) % len(configs)
            for cfg in configs[shift:] + configs[:shift]:
                n, dt = timed(cfg, [prompts[p]], 1, [p])
                per_rep[(cfg.key, 1)][0] += n
                per_rep[(cfg.key, 1)][1] += dt
        b8 = [cfg for cfg in configs if BATCH in cfg.batches]
        shift = r % len(b8)
        for cfg in b8[shift:] + b8[:shift]:
            n, dt = timed(cfg, prompts[:BATCH], BATCH, list(range(BATCH)))
            per_rep[(cfg.key, BATCH)][0] += n
            per_rep[(cfg.key, BATCH)][1] += dt
        for cfg in configs:
            for b in cfg.batches:
                n, dt = per_rep[(cfg.key, b)]
                cfg.tallies[b].rates.append(n / dt)
        log.info(
            "repeat %d/%d done in %.0fs: %s", r + 1, repeats, time.perf_counter() - t_rep,
            ", ".join(f"{k}@{b} {n / dt:.1f} tok/s" for (k, b), (n, dt) in per_rep.items()),
        )
