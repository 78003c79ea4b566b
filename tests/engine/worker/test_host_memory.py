"""A CPU engine keeps freed memory for reuse: a large temporary comes from the heap, not a fresh mmap."""

from __future__ import annotations

import ctypes

import torch

from engine import LLM
from engine.core import loader
from engine.worker.host_memory import keep_freed_memory


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mapped_bytes() -> int:
    """Bytes glibc holds in blocks it mmapped one by one (mallinfo2: glibc >= 2.33)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    return libc.mallinfo2().hblkhd


def test_a_large_cpu_temporary_after_keep_freed_memory_is_not_a_fresh_mapping():
    assert keep_freed_memory(), "this test runs on glibc"
    before = _mapped_bytes()
    # 40 MiB: above the ceiling of glibc's own dynamic mmap threshold (32 MiB), so only the setting keeps it off
    # mmap, whatever earlier tests in this process freed.
    t = torch.empty(10 * 2**20, dtype=torch.float32)
    t.fill_(1.0)
    assert _mapped_bytes() - before < 2**20, "the 40 MiB tensor was mmapped: its pages fault in on every use"
    del t


def test_loading_a_model_onto_the_cpu_sets_the_allocator(monkeypatch, model_sets):
    calls = []
    monkeypatch.setattr(loader, "keep_freed_memory", lambda: calls.append(1) or True)
    LLM(str(model_sets["llama"].target), device="cpu")
    assert calls, "a CPU engine loaded with glibc's default thresholds"
