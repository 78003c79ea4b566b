"""What one rank holds of a sharded target, computed from the model's tensor-parallel plan without sharding it
(the dry run's models are on the meta device)."""

from __future__ import annotations

import re

import torch
from torch.distributed.tensor import DTensor

# Styles of transformers' plans that split a module's weight over the ranks; the rest keep it whole on each.
_SPLITTING = ("colwise", "rowwise", "embedding")


def local(t: torch.Tensor) -> torch.Tensor:
    """What this process holds of a tensor: a rank's shard of a sharded one, else the tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def rank_weight_bytes(model: torch.nn.Module, size: int) -> int:
    """Bytes of weights one of ``size`` ranks holds: split weights by ``size`` (rounded up, as the last rank's
    slice may be the longer), the others whole. A rowwise layer's bias is added after the all-reduce, whole."""
    plan = getattr(model, "_tp_plan", None) or {}
    split = [re.compile(re.escape(name).replace(r"\*", r"\d+") + r"$") for name, style in plan.items()
             if style.startswith(_SPLITTING)]
    rowwise = [re.compile(re.escape(name).replace(r"\*", r"\d+") + r"$") for name, style in plan.items()
               if style.startswith("rowwise")]
    total = 0
    for name, p in model.named_parameters():
        module, _, kind = name.rpartition(".")
        nbytes = p.numel() * p.element_size()
        whole = kind == "bias" and any(r.match(module) for r in rowwise)
        total += nbytes if whole or not any(r.match(module) for r in split) else -(-nbytes // size)
    return total + sum(b.numel() * b.element_size() for b in model.buffers())
