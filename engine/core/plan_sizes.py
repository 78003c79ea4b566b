"""The sizes a memory plan needs, read off models (loaded, or built on the meta device) and off the machine."""

from __future__ import annotations

import itertools
import os

import torch

from engine.core.memory_plan import GiB, MemoryPlan, ModelSize, PlanError, PlanRequest, plan_memory
from engine.parallel.shares import local
from engine.types.config import EngineConfig

# A split target (device_map) has no one device to plan for: its cache gets this unless kv_cache_memory_gb says.
SPLIT_KV_DEFAULT_GB = 1.0


def model_size(model: torch.nn.Module, block_bytes: int) -> ModelSize:
    """Weights as held (tied ones once; a rank's own shards); on the meta device, what loading would hold."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    weights = sum(local(t).numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    return ModelSize(weights, block_bytes, hidden, int(getattr(config, "intermediate_size", 0) or 4 * hidden),
                     int(getattr(config, "vocab_size", 0) or 0))


def host_available_bytes() -> int:
    """RAM the kernel could give this process now (MemAvailable), else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def request(config: EngineConfig, device: str, memory_bytes: int, target: ModelSize, draft: ModelSize | None,
            dtype: torch.dtype, model_limit: int, cuda_graphs: bool, split: bool = False,
            ranks: int = 1) -> PlanRequest:
    kv_gb = config.kv_cache_memory_gb if config.kv_cache_memory_gb is not None or not split else SPLIT_KV_DEFAULT_GB
    return PlanRequest(
        device=device, memory_bytes=memory_bytes, share=config.memory_utilization, target=target, draft=draft,
        dtype_bytes=torch.finfo(dtype).bits // 8, block_size=config.block_size, k_max=config.k_max,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        model_limit=model_limit, max_model_len=config.max_model_len, cuda_graphs=cuda_graphs,
        kv_cache_bytes=None if kv_gb is None else int(kv_gb * GiB), num_kv_blocks=config.num_kv_blocks, split=split,
        ranks=ranks,
    )


def plan_loaded(config: EngineConfig, target: torch.nn.Module, target_block_bytes: int,
                draft: torch.nn.Module | None, draft_block_bytes: int, device: torch.device, dtype: torch.dtype,
                model_limit: int, cuda_graphs: bool, split: bool, ranks: int = 1) -> MemoryPlan:
    """The plan of a real start, from the loaded models and the device they are on; with ``ranks`` of a
    tensor-parallel target, rank 0's plan, which every rank's cache follows (on CPU they share the host's RAM)."""
    sizes = model_size(target, target_block_bytes), (model_size(draft, draft_block_bytes) if draft else None)
    weights = sum(s.weight_bytes for s in sizes if s)
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        memory = (host_available_bytes() + weights) // ranks  # what was available before the weights came in
    plan = plan_memory(request(config, device.type, memory, sizes[0], sizes[1], dtype, model_limit, cuda_graphs,
                               split, ranks))
    if device.type == "cuda" and not split and config.kv_cache_memory_gb is None and config.num_kv_blocks is None:
        free = torch.cuda.mem_get_info(device)[0]
        if plan.kv_bytes + plan.activation_bytes > free:
            raise PlanError(
                f"the plan's KV cache ({plan.kv_bytes / GiB:.1f} GiB) and activations "
                f"({plan.activation_bytes / GiB:.1f} GiB) need more than the {free / GiB:.1f} GiB free on {device} "
                f"(other processes hold the rest): lower --memory-utilization, or free the device")
    return plan
