"""``specd serve --dry-run``: what a start would plan, without loading a weight.

The models are built from their configs on the meta device (no memory, no weights read) and probed for their KV
layout exactly as a real start probes them; the tokenizers are checked as a real start checks them; the memory plan
is engine.core.memory_plan's. ``device_memory`` plans for a device this machine need not have.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine.core.loader import DEFAULT_CONTEXT, check_same_tokenizer, load_tokenizer
from engine.core.memory_plan import MemoryPlan, ModelSize, plan_memory
from engine.core.plan_sizes import host_available_bytes, model_size, request
from engine.layers.kv_cache import LayerShape, PagedKVCache
from engine.models.eagle_head import Eagle3Head, head_config, is_eagle_head
from engine.parallel.checks import check_target
from engine.parallel.shares import rank_weight_bytes
from engine.types.config import EngineConfig
from engine.worker.loading import device_map_kind, probe_layers, resolve_dtype

META = torch.device("meta")


@dataclass(frozen=True)
class DryRun:
    plan: MemoryPlan
    device: str
    dtype: torch.dtype
    target_params: int
    draft_params: int


def _meta_model(path: str, dtype: torch.dtype, trust_remote_code: bool) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with META:
        return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)


def _limit(model: torch.nn.Module) -> int | None:
    return getattr(model.config.get_text_config(), "max_position_embeddings", None)


def dry_run(config: EngineConfig, device_memory: int | None = None) -> DryRun:
    """The plan a start with ``config`` would make. Raises what that start would raise (a ValueError)."""
    if config.device != "auto":
        kind = torch.device(config.device).type
    elif config.device_map is not None:
        kind = device_map_kind(config.device_map).type
    else:
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda" and device_memory is None and not torch.cuda.is_available():
        raise ValueError("no CUDA device here to read the memory of: give --device-memory (e.g. 80GiB)")
    dtype = resolve_dtype(config.dtype, torch.device(kind))
    target = _meta_model(config.model, dtype, config.trust_remote_code)
    shapes, _ = probe_layers(target, META)
    sizes: list[ModelSize] = [model_size(target, PagedKVCache.bytes_per_block(shapes, config.block_size, dtype))]
    ranks = config.tensor_parallel_size
    if ranks > 1:
        cuda_here = kind == "cuda" and device_memory is None
        check_target(ranks, target.config, kind, torch.cuda.device_count() if cuda_here else None,
                     config.uses_draft_model and is_eagle_head(config.draft_model or ""))
        # Rank 0's share: its weights and its KV heads (the draft, whole, is on rank 0 too).
        sizes[0] = replace(sizes[0], weight_bytes=rank_weight_bytes(target, ranks),
                           block_bytes=sizes[0].block_bytes // ranks)
    limits = [_limit(target)]
    eagle = config.uses_draft_model and is_eagle_head(config.draft_model or "")
    draft_params = 0
    if eagle:
        assert config.draft_model is not None
        hc = head_config(config.draft_model)
        text = target.config.get_text_config()
        with META:
            head = Eagle3Head(hc, text.hidden_size, own_embeddings=True).to(dtype)
        head_dim = getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads
        layer = [LayerShape(hc.num_key_value_heads, head_dim, head_dim)]
        sizes.append(model_size(head, PagedKVCache.bytes_per_block(layer, config.block_size, dtype)))
        draft_params = sum(p.numel() for p in head.parameters())
    elif config.uses_draft_model:
        assert config.draft_model is not None
        check_same_tokenizer(load_tokenizer(config.model, config.trust_remote_code),
                             load_tokenizer(config.draft_model, config.trust_remote_code), config.model,
                             config.draft_model)
        draft = _meta_model(config.draft_model, dtype, config.trust_remote_code)
        draft_shapes, _ = probe_layers(draft, META)
        sizes.append(model_size(draft, PagedKVCache.bytes_per_block(draft_shapes, config.block_size, dtype)))
        limits.append(_limit(draft))
        draft_params = sum(p.numel() for p in draft.parameters())
    known = [x for x in limits if x]
    split = config.device_map is not None
    graphs = (config.cuda_graphs if config.cuda_graphs is not None else kind == "cuda" and not split and ranks == 1
              ) and not eagle
    weights = sum(s.weight_bytes for s in sizes)
    memory = device_memory if device_memory is not None else (
        torch.cuda.get_device_properties(0).total_memory if kind == "cuda"
        else (host_available_bytes() + weights) // ranks)
    plan = plan_memory(request(config, kind, memory, sizes[0], sizes[1] if len(sizes) > 1 else None, dtype,
                               min(known) if known else DEFAULT_CONTEXT, graphs, split, ranks))
    return DryRun(plan, kind, dtype, sum(p.numel() for p in target.parameters()), draft_params)
