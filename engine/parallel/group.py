"""Joining the ranks: one process per rank, a process group for the forwards' collectives and a gloo group for the
messages rank 0 sends between them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
# A forward's all-reduce that waits this long has lost a rank: better an error than a hang.
FORWARD_TIMEOUT = timedelta(minutes=10)
# The other ranks wait on the message group between steps, for as long as the server idles.
IDLE_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class Ranks:
    rank: int
    size: int
    device: torch.device  # this rank's
    control: Any  # the gloo group rank 0's messages travel in (pickled objects: never through NCCL)


def device_type(device: str) -> str:
    """The kind of device a ``--device`` value puts the ranks on."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def join(kind: str) -> Ranks:
    """This process's rank, from torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
    which engine.parallel.launch also sets for the ranks it starts."""
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cpu") if kind == "cpu" else torch.device(kind, local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        # The ranks share the host's cores: each would otherwise start a thread per core and all of them contend.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    if not dist.is_initialized():
        dist.init_process_group(BACKENDS[device.type], init_method="env://", rank=rank, world_size=size,
                                timeout=FORWARD_TIMEOUT, device_id=device if device.type == "cuda" else None)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return Ranks(rank, size, device, control)
