"""Short-query attention on the CPU, reading the paged cache in place: engine/layers/kernels/paged_attention.cpp,
built with the machine's C++ compiler against this torch when a float32 model is loaded on the CPU, and loaded as
the operator ``specd::paged_attention``: a compiled forward (engine.worker.compiled) calls it from its C++ wrapper,
where an operator defined in Python cost each layer a trip through the interpreter (~25 us).

Why a kernel of our own: on the CPU the padded path gathers each sequence's keys into a copy per layer and runs
SDPA over the copy, so a 32-sequence decode step reads its K/V three times (the cache, the copy written, the copy
read) and every padded key too. torch has no CPU kernel that reads through a block table (FlexAttention's CPU path
and an inductor-generated indirect read were measured slower than the gather), and of the CPU libraries that have
one, intel-extension-for-pytorch stopped at 2.8.0 (built for torch 2.8) and vLLM's CPU build is not on PyPI.
benchmarks/cpu_attention.py measures both side by side, one layer and whole forwards
(benchmarks/results/cpu_attention.json).

No compiler, an unwritable cache, or a layout the kernel does not take (not float32, a sliding window): the
caller keeps the gather path, which computes the same attention.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.native.build import operators

SOURCE = Path(__file__).with_name("kernels") / "paged_attention.cpp"
# -ffast-math lets gcc vectorise expf through glibc's vector math library (SDPA's own CPU kernel uses an
# approximate exp too) and reorder the dot products' sums; the kernel never produces an infinity or a NaN. It is
# given to the compile step only: linked with -ffast-math, gcc adds crtfastmath.o, whose constructor turns on
# flush-to-zero for the whole process when the library loads (subnormal floats become 0 everywhere; hypothesis,
# in the fuzz tests, caught it).
COMPILE = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]

_LOADED: list[bool] = []  # [] before the first build


def kernel() -> bool:
    """Whether specd::paged_attention is loaded, building it on the first call (~15 s once per machine)."""
    if not _LOADED:
        what = "the CPU attention kernel (without it: a copy of the keys per layer)"
        _LOADED.append(operators(SOURCE, COMPILE, what))
        if _LOADED[0]:
            torch.library.register_fake("specd::paged_attention")(_shape)
    return _LOADED[0]


def _shape(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
           positions: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def usable(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, sliding_window: int | None) -> bool:
    """Whether this layer's short queries ``q`` [G, Q, H, D] can go through the kernel (under compile, decided once
    at trace time: the answer depends only on the model and the device)."""
    return sliding_window is None and _takes(q, k_cache, v_cache) and kernel()


def _takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    H, D = q.shape[2], q.shape[3]
    Hkv = k_cache.shape[1]
    return (q.device.type == "cpu" and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
            and k_cache.shape[2] == v_cache.shape[2] == D and H % Hkv == 0
            and k_cache.is_contiguous() and v_cache.is_contiguous())


def paged_attention(
    q: torch.Tensor,  # [G, Q, H, D] float32
    k_cache: torch.Tensor,  # [slots, Hkv, D] float32
    v_cache: torch.Tensor,  # [slots, Hkv, D] float32
    slots: torch.Tensor,  # [G, C] long: cache slot of key position c
    positions: torch.Tensor,  # [G, Q] long: query i of sequence g sees key positions [0, positions[g, i]]
    scale: float,
) -> torch.Tensor:  # [G, Q, H, D]
    """specd::paged_attention, where ``usable`` said the kernel takes these tensors (it raises ValueError, naming
    the shapes, where it does not)."""
    assert kernel(), "specd::paged_attention called where usable() is false"
    return torch.ops.specd.paged_attention(q, k_cache, v_cache, slots, positions, scale)
