"""Linear layers over a few rows on CPU, under torch.compile, as one fused multiply-reduce loop.

At a few rows a linear layer is a matrix-vector product bound by reading its weight. On the
project's CPU (AMD EPYC, AVX-512) MKL's sgemm reads the embedded target's 55 MB of weights in about
7.5 ms at one to five rows, where a plain read of them takes 0.9 ms. Written as
``(w[:, None, :] * x[None]).sum(-1)``, the same product is a reduction inductor generates itself:
an outer loop over the weight's rows (split across threads) that reads each row once and keeps it
in L1 while it takes the few inputs' dot products, vectorised along the row. Eager code keeps
F.linear: unfused, the product would materialise a weight-sized temporary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# At most this many rows take the fused loop. Measured on a target-shaped stack of layers: 2.2x
# faster than MKL at 3 to 10 rows; MKL's gemm, which reuses each weight block across rows in
# registers, catches up at about 40.
SMALL_ROWS = 16


class SmallRowsLinear(nn.Linear):
    """nn.Linear whose compiled CPU forward over at most SMALL_ROWS rows is a fused multiply-reduce."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        # With dynamic shapes this adds a guard (rows <= SMALL_ROWS), so a larger batch compiles a graph of its own.
        # Inference only (the engine's forwards run under inference_mode): the realising prim has no backward.
        fused = torch.compiler.is_compiling() and not torch.is_grad_enabled() and x.device.type == "cpu"
        if not (fused and rows <= SMALL_ROWS):
            return F.linear(x, self.weight, self.bias)
        # Realise the input first: left to itself inductor inlines the producer (an RMSNorm, SiLU(gate) * up) into
        # the reduction's inner loop and recomputes it for every output feature, which made a 5-row forward 3-8x
        # slower than MKL's instead of 2x faster.
        flat = torch.ops.prims.inductor_force_stride_order(x.reshape(rows, x.shape[-1]), [x.shape[-1], 1])  # [R, in]
        # [out, 1, in] * [1, R, in] summed over in: the weight's row is the outer loop, so it is read once
        y = (self.weight[:, None, :] * flat[None]).sum(-1).t()  # [R, out]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


def install(model: nn.Module) -> int:
    """Turns the model's float32 CPU nn.Linear layers into SmallRowsLinear (same parameters, same eager
    forward); returns how many."""
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32:
            module.__class__ = SmallRowsLinear
            n += 1
    return n
