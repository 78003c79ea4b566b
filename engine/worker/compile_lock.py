"""One compile of a model's graph files at a time on a host: two servers of one model that start together (replicas
sharing a cache volume, a benchmark's two systems) each found the same files missing and compiled them twice over,
each child at half the cores. The second now waits for the first and compiles only what is still missing after it;
a server of another model does not wait (a lock per file set, named for its first file)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

SUFFIX = ".lock"  # beside the first file: compile_cache.pack leaves these out


@contextlib.contextmanager
def one_at_a_time(files: Sequence[Path], needed: Callable[[Path], object]) -> Iterator[None]:
    """Held while this process compiles ``files``, where ``needed`` says one of them must be (nothing to compile:
    nothing held). Whatever the holder wrote is there once this returns: check ``files`` again inside. The lock is
    the kernel's (flock): a holder that dies releases it."""
    if not files or not any(needed(f) for f in files):
        yield
        return
    first = files[0]
    first.parent.mkdir(parents=True, exist_ok=True)
    with first.with_name(first.name + SUFFIX).open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            t0 = time.perf_counter()
            logger.info("compile: another process is compiling %s; waiting for it", first.name)
            fcntl.flock(lock, fcntl.LOCK_EX)
            logger.info("compile: the other process's compile ended after %.1fs", time.perf_counter() - t0)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
