"""The process's heap once the engine is built: every object then (torch's and transformers' modules, the
tokenizer, the loaded graphs: about 600,000 for the embedded pair) lives as long as the engine, yet Python's
cyclic collector walked them all at every full collection: 0.3-0.45 s with the GIL held, a stall of every
request's stream, about one a minute under load (2 CPU cores). Frozen, they are left out of every collection,
and a full one took 6-13 ms."""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def settle() -> None:
    """Collects what is garbage now, then freezes the rest: whatever is frozen is never collected, so the
    garbage goes first."""
    t = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.info("froze %d objects the engine keeps out of garbage collection (%.2f s)", gc.get_freeze_count(),
                time.perf_counter() - t)
