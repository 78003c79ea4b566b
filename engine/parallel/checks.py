"""What a target must be for tensor parallelism, checked from its config before anything loads."""

from __future__ import annotations

from typing import Any


class TensorParallelError(ValueError):
    """The target cannot be sharded as asked."""


def check_target(size: int, config: Any, device_kind: str, cuda_devices: int | None, eagle: bool = False) -> None:
    """Raises TensorParallelError naming the way out. ``config``: the target's transformers config;
    ``cuda_devices``: how many this machine has (None: planning for another machine, not checked); ``eagle``: an
    EAGLE head drafts."""
    if size == 1:
        return
    if eagle:
        raise TensorParallelError("an EAGLE head reads the target's hidden states, which no rank holds whole: with "
                                  "tensor_parallel_size > 1 draft with a draft model, n-gram or suffix lookup")
    text = config.get_text_config()
    archs = ", ".join(getattr(config, "architectures", None) or [config.model_type])
    if not getattr(text, "base_model_tp_plan", None):
        raise TensorParallelError(
            f"architecture {archs} has no tensor-parallel plan in transformers (its config's base_model_tp_plan "
            "is empty), so it cannot be sharded: serve it on one device, or split it across GPUs with device_map")
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    if heads % size or kv_heads % size:
        # Each rank holds whole heads (and its own KV heads in its paged cache).
        fits = [n for n in range(2, kv_heads + 1) if heads % n == 0 and kv_heads % n == 0]
        raise TensorParallelError(
            f"tensor_parallel_size {size} does not divide the target's {heads} attention heads and {kv_heads} KV "
            f"heads: " + (f"use one of {fits}" if fits else "it cannot be sharded by heads; serve it on one device"))
    if device_kind not in ("cpu", "cuda"):
        raise TensorParallelError(f"tensor parallelism runs on cpu (gloo) or cuda (NCCL), not {device_kind}")
    if device_kind == "cuda" and cuda_devices is not None and size > cuda_devices:
        raise TensorParallelError(f"tensor_parallel_size {size} needs {size} GPUs, one per rank; this machine has "
                                  f"{cuda_devices}")
