"""glibc's allocator set to keep freed memory in the process, for models that run on the CPU.

A CPU forward allocates its temporaries through malloc. glibc serves a block above M_MMAP_THRESHOLD
(128 KiB, raised as such blocks are freed, to at most 32 MiB) with a fresh mmap, and hands the top of
its heap back to the kernel once more than M_TRIM_THRESHOLD of it is free; either way the next
allocation of that size faults its pages in again, zeroed by the kernel. A batched step's large
temporaries are the same every step (at 32 sequences each attention layer gathers ~20 MB of keys and
values), and whether they meet fresh pages depended on the process's history: in one process a
32-sequence verify forward of the embedded target took ~6,000 page faults every time (24 MB of new
pages), and a decode forward 8,700 faults and 53 ms against 36 ms without. With both thresholds
raised, freed blocks stay for reuse and the faults go. The cost: the process keeps its peak heap,
which a server holds anyway. jemalloc or tcmalloc through LD_PRELOAD, the usual advice for CPU
inference with PyTorch, does the same but must be installed and preloaded; this needs neither.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_KEEP = 1 << 30  # bytes: no step's temporaries come near it


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (process-wide; harmless to repeat). False where the C library is
    not glibc (musl, macOS), which is left as it is."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.gnu_get_libc_version  # noqa: B018 (glibc's alone: elsewhere mallopt means other things, or is absent)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, _KEEP) == 1 and mallopt(_M_TRIM_THRESHOLD, 2 * _KEEP) == 1
    if not ok:
        logger.warning("glibc refused the allocator thresholds; large CPU temporaries may page-fault every step")
    return ok
