"""Short-query attention on the CPU, reading the paged cache in place: engine/layers/kernels/paged_attention.c, built
with the machine's C compiler when a float32 model is loaded on the CPU, and called as the custom op
``specd::paged_attention``, so a compiled forward (engine.worker.compiled) keeps it inside its graph.

Why a kernel of our own: on the CPU the padded path gathers each sequence's keys into a copy per layer and runs
SDPA over the copy, so a 32-sequence decode step reads its K/V three times (the cache, the copy written, the copy
read) and every padded key too. torch has no CPU kernel that reads through a block table (FlexAttention's CPU path
and an inductor-generated indirect read were measured slower than the gather), and of the CPU libraries that have
one, intel-extension-for-pytorch stopped at 2.8.0 (built for torch 2.8) and vLLM's CPU build is not on PyPI.
benchmarks/cpu_attention.py measures both side by side: eager forwards of the embedded target at 32 sequences
1.55x faster at one token each, 2.0x at five (benchmarks/results/cpu_attention.json).

No compiler, an unwritable cache, or a layout the kernel does not take (not float32, a sliding window): the
caller keeps the gather path, which computes the same attention.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from engine.native.build import library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "paged_attention.c"
# -ffast-math lets gcc vectorise expf through glibc's vector math library (SDPA's own CPU kernel uses an
# approximate exp too) and reorder the dot products' sums; the kernel never produces an infinity or a NaN. It is
# given to the compile step only: linked with -ffast-math, gcc adds crtfastmath.o, whose constructor turns on
# flush-to-zero for the whole process when the library loads (subnormal floats become 0 everywhere; hypothesis,
# in the fuzz tests, caught it).
COMPILE = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
LINK = ["-shared", "-fopenmp"]

_LIB: list[ctypes.CDLL | None] = []  # [] before the first build; [None] once it failed


def _build() -> ctypes.CDLL | None:
    handle = library(SOURCE, COMPILE, LINK, "the CPU attention kernel (without it: a copy of the keys per layer)")
    if handle is None:
        return None
    fn = handle.specd_paged_attention
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    fn.restype = None
    return handle


def kernel() -> ctypes.CDLL | None:
    """The built library, building it on the first call; None where it cannot be built."""
    if not _LIB:
        try:
            _LIB.append(_build())
        except OSError:
            logger.warning("building the CPU attention kernel failed; keeping the gather path", exc_info=True)
            _LIB.append(None)
    return _LIB[0]


def usable(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, sliding_window: int | None) -> bool:
    """Whether this layer's short queries ``q`` [G, Q, H, D] can go through the kernel (under compile, decided once
    at trace time: the answer depends only on the model and the device)."""
    return sliding_window is None and _takes(q, k_cache, v_cache) and kernel() is not None


def _takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    H, D = q.shape[2], q.shape[3]
    Hkv = k_cache.shape[1]
    return (q.device.type == "cpu" and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
            and k_cache.shape[2] == v_cache.shape[2] == D and H % Hkv == 0
            and k_cache.is_contiguous() and v_cache.is_contiguous())


@torch.library.custom_op("specd::paged_attention", mutates_args=(), device_types="cpu")
def paged_attention(
    q: torch.Tensor,  # [G, Q, H, D] float32
    k_cache: torch.Tensor,  # [slots, Hkv, D] float32
    v_cache: torch.Tensor,  # [slots, Hkv, D] float32
    slots: torch.Tensor,  # [G, C] long: cache slot of key position c
    positions: torch.Tensor,  # [G, Q] long: query i of sequence g sees key positions [0, positions[g, i]]
    scale: float,
) -> torch.Tensor:  # [G, Q, H, D]
    lib = kernel()
    assert lib is not None, "specd::paged_attention called where usable() is false"
    q, slots, positions = q.contiguous(), slots.contiguous(), positions.contiguous()
    G, Q, H, D = q.shape
    Hkv = k_cache.shape[1]
    if not _takes(q, k_cache, v_cache):
        raise ValueError(f"specd::paged_attention: q {tuple(q.shape)} against a cache of {tuple(k_cache.shape)}")
    out = torch.empty_like(q)
    # ctypes lets go of the GIL for the call, as torch's own kernels do.
    lib.specd_paged_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                              positions.data_ptr(), out.data_ptr(), G, Q, H, Hkv, D, slots.shape[1], scale,
                              torch.get_num_threads())
    return out


@paged_attention.register_fake
def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
      scale: float) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)
