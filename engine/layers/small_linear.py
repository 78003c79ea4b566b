"""Linear layers on CPU under torch.compile: over one row a fused multiply-reduce loop, over a few our own
kernel (specd::small_rows_linear), over more a oneDNN product with the weight packed in advance.

At a few rows a linear layer is a matrix-vector product bound by reading its weight. On the
project's CPU (AMD EPYC, AVX-512) MKL's sgemm reads the embedded target's 55 MB of weights in about
7.5 ms at one to five rows, where a plain read of them takes 0.9 ms. Written as
``(w[:, None, :] * x[None]).sum(-1)``, the same product is a reduction inductor generates itself:
an outer loop over the weight's rows (split across threads) that reads each row once and keeps it
in L1 while it takes the few inputs' dot products, vectorised along the row. Eager code keeps
F.linear: unfused, the product would materialise a weight-sized temporary.

From 2 to SMALL_ROWS rows (a verify of one sequence's drafts, a batch decoding or verifying) that loop waits
on its adds' latency: each row past the first cost the embedded target's compiled forward 0.94 ms on the 2-core
AVX2 host, over twice its multiply-adds at the host's matrix-product rate. kernels/small_rows_linear.cpp reads
the weight from a copy packed at install into panels of 16 outputs (``pack``), so a tile of rows keeps its
outputs in accumulators and uses each weight vector it loads for every row (benchmarks/small_rows_linear.py).
It is a C++ operator, so a compiled graph calls it without Python. The panels are a second copy of the weights
in memory. At one row the loop stays: fused with the rest of the forward into one parallel region, it reads the
weights as fast, and one row is already a graph of its own (dynamo specializes a size of 1). Without a C++
compiler the loop takes these rows too, and no panels are made.

Past SMALL_ROWS (prompt chunks, large batches) the product goes to oneDNN with the weight reordered
once, at install, into its blocked layout, rather than to MKL, whose sgemm runs well below this CPU's
AVX-512 peak: compiled forwards of the embedded target at 20 to 96 rows 22-34% faster, the draft's 8-13%
(benchmarks/compiled_linear.py). The packed copy is a third copy of those weights in memory.
"""

from __future__ import annotations

import itertools
import weakref
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.tracing import tracing
from engine.native.build import operators

# At most this many rows take the loop or the kernel: compiled graphs and their warm-up layouts split here
# (engine.worker.warm_up_layouts). Over a stack of linears shaped as the embedded target's, the kernel beat packed
# oneDNN 1.36x at 8 and 16 rows, 1.11x at 64 and 1.03x at 128; over the draft's, 2.5x at 8 and 1.28x at 96 (2-core
# AVX2, 2 threads). A split at 16 put a step in the step-cost profile (17 rows cost far more than 16), and 8
# sequences verifying ran 0.88x no speculation; at 64 every batch of up to 8 verifying stays on the kernel.
SMALL_ROWS = 128
PANEL = 16  # outputs per panel of the few-rows kernel's packed weight (kWidth there)


# oneDNN-packed weights by key. A traced graph cannot carry oneDNN's opaque tensors (inductor takes them only as
# frozen constants), so the custom op below receives the key, an int the graph holds as a constant, and looks
# the packed weight up here; the layer itself keeps it alive.
_PACKED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def stable_key(name: str, layer: str) -> int:
    """The key of layer ``layer`` of the model named ``name`` in graphs compiled in another process
    (engine.worker.precompile), where this process's counter would have given other numbers."""
    return zlib.crc32(f"{name}/{layer}".encode()) & 0x7FFFFFFF


SOURCE = Path(__file__).with_name("kernels") / "small_rows_linear.cpp"
_LOADED: list[bool] = []  # [] before the first build


def rows_kernel() -> bool:
    """Whether specd::small_rows_linear is loaded, building it on the first call (~12 s once per machine)."""
    if not _LOADED:
        _LOADED.append(operators(SOURCE, ["-O3", "-march=native", "-fopenmp"], "the few-rows linear kernel"))
        if _LOADED[0]:
            torch.library.register_fake("specd::small_rows_linear")(_small_rows_linear_shape)
    return _LOADED[0]


def _small_rows_linear_shape(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], n)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] as the few-rows kernel reads it: [ceil(N / PANEL), K, PANEL], panel p holding weight rows
    p * PANEL ... transposed, with zero rows past N."""
    n, k = weight.shape
    padded = torch.cat([weight, weight.new_zeros(-n % PANEL, k)]) if n % PANEL else weight
    return padded.reshape(-1, PANEL, k).transpose(1, 2).contiguous()


@torch.library.custom_op("specd::packed_linear", mutates_args=(), device_types="cpu")
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: int) -> torch.Tensor:
    """``x`` [R, in] through the layer whose packed weight is ``_PACKED[key]`` (``weight`` [out, in], the same
    values, gives the output's shape while tracing): [R, out]."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), _PACKED[key], bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


class SmallRowsLinear(nn.Linear):
    """nn.Linear whose compiled CPU forward over one row is a fused multiply-reduce, over at most SMALL_ROWS rows
    specd::small_rows_linear, and over more a packed oneDNN product."""

    packed_key: int | None = None
    few_rows_kernel = True  # False: the fused loop up to SMALL_ROWS rows, as before the kernel (a benchmark's arm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        # With dynamic shapes this adds a guard (rows <= SMALL_ROWS), so a larger batch compiles a graph of its own.
        # Inference only (the engine's forwards run under inference_mode): the realising prim has no backward.
        fused = tracing() and not torch.is_grad_enabled() and x.device.type == "cpu"
        if not fused or (rows > SMALL_ROWS and self.packed_key is None):
            return F.linear(x, self.weight, self.bias)
        if rows > SMALL_ROWS:
            y = packed_linear(x.reshape(rows, x.shape[-1]), self.weight, self.bias, self.packed_key)
            return y.reshape(*x.shape[:-1], y.shape[-1])
        panels = getattr(self, "panels", None)  # the weight packed for the few-rows kernel, where it is built
        if rows > 1 and self.few_rows_kernel and panels is not None:
            y = torch.ops.specd.small_rows_linear(x.reshape(rows, x.shape[-1]), panels, self.bias, self.out_features)
            return y.reshape(*x.shape[:-1], y.shape[-1])
        # Realise the input first: left to itself inductor inlines the producer (an RMSNorm, SiLU(gate) * up) into
        # the reduction's inner loop and recomputes it for every output feature, which made a 5-row forward 3-8x
        # slower than MKL's instead of 2x faster.
        flat = torch.ops.prims.inductor_force_stride_order(x.reshape(rows, x.shape[-1]), [x.shape[-1], 1])  # [R, in]
        # [out, 1, in] * [1, R, in] summed over in: the weight's row is the outer loop, so it is read once
        y = (self.weight[:, None, :] * flat[None]).sum(-1).t()  # [R, out]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


def install(model: nn.Module, stable_name: str | None = None) -> int:
    """Turns the model's float32 CPU nn.Linear layers into SmallRowsLinear (same parameters, same eager
    forward) with each weight packed for the few-rows kernel where it builds and for oneDNN where that is built in;
    returns how many. ``stable_name``:
    key them by ``stable_key`` (for a process that compiles graphs for another)."""
    n = 0
    for layer, module in model.named_modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32:
            module.__class__ = SmallRowsLinear
            # Built before a graph is traced or loaded (a loaded graph calls it by name). The panels are not in the
            # state dict: made from the weight, as the oneDNN copy below.
            if rows_kernel():
                module.register_buffer("panels", pack(module.weight.detach()), persistent=False)
            if torch.backends.mkldnn.is_available():
                # Reordered for 32 rows; measured as fast as a copy reordered for the actual rows from 1 to 96.
                module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), 32)
                module.packed_key = next(_KEYS) if stable_name is None else stable_key(stable_name, layer)
                _PACKED[module.packed_key] = module.packed
            n += 1
    return n


def rekey(model: nn.Module, name: str) -> bool:
    """Gives the packed layers of ``model`` (installed here) the keys graphs compiled elsewhere under ``name``
    hold (they guard a layer's key as the constant it is). False, changing nothing, where a key is another live
    layer's (the same name loaded twice in this process): those graphs cannot run here."""
    layers = [(stable_key(name, n), m) for n, m in model.named_modules() if getattr(m, "packed_key", None) is not None]
    if any(_PACKED.get(key) is not None and _PACKED.get(key) is not m.packed for key, m in layers):
        return False
    for key, m in layers:
        _PACKED[key] = m.packed
        m.packed_key = key
    return True
