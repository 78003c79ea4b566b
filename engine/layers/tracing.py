"""Whether this thread is tracing a forward for torch.compile.

``torch.compiler.is_compiling()`` answers for the whole process: torch holds it True while any thread
compiles, so while a background warm-up compiles, the serving thread's eager forwards would take the
branches meant for a trace (engine.layers.small_linear's fused loop, run eagerly: batch-1 requests got 1-8 tok/s
instead of ~150). Here
the answer is also asked of this thread: is it inside a compiled forward (``compiled_call``)? Under
dynamo both reads fold to constants, the thread's flag with a guard on it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_local = threading.local()


@contextmanager
def compiled_call() -> Iterator[None]:
    """Around a call of a compiled function: its trace, if it traces, runs in this thread."""
    outer = getattr(_local, "inside", False)
    _local.inside = True
    try:
        yield
    finally:
        _local.inside = outer


def tracing() -> bool:
    return torch.compiler.is_compiling() and getattr(_local, "inside", False)
