"""The paged KV cache: one flat slot array per layer, addressed through block tables."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerShape:
    num_kv_heads: int
    head_dim: int  # of the keys (and queries)
    v_head_dim: int  # of the values: larger or smaller than the keys' in some attentions (DeepSeek-V2's MLA)


class PagedKVCache:
    """Per layer, K and V of shape ``[num_blocks * block_size, num_kv_heads, head_dim]``.

    Slot ``block * block_size + offset`` holds the token at that offset of that block, so a block
    table plus a position gives a slot with arithmetic alone; nothing is ever moved. ``device`` is one
    device, or one per layer for a model split across devices (each layer's cache beside its attention).
    One slot past the last block, ``scratch_slot``, belongs to no block: padding tokens of a static-shape
    forward (engine.worker.graphs) write their K/V there, where nothing reads them as context.
    """

    def __init__(
        self,
        layer_shapes: list[LayerShape],
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | Sequence[torch.device],
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        slots = num_blocks * block_size
        self.scratch_slot = slots
        devices = [device] * len(layer_shapes) if isinstance(device, torch.device) else list(device)
        if len(devices) != len(layer_shapes):
            raise ValueError(f"{len(devices)} devices for {len(layer_shapes)} layers")
        self.devices = devices
        shaped = list(zip(layer_shapes, devices))
        self.k = [torch.zeros(slots + 1, s.num_kv_heads, s.head_dim, dtype=dtype, device=d) for s, d in shaped]
        self.v = [torch.zeros(slots + 1, s.num_kv_heads, s.v_head_dim, dtype=dtype, device=d) for s, d in shaped]

    @staticmethod
    def bytes_per_block(layer_shapes: list[LayerShape], block_size: int, dtype: torch.dtype) -> int:
        per_token = sum(s.num_kv_heads * (s.head_dim + s.v_head_dim) for s in layer_shapes)
        return per_token * block_size * torch.finfo(dtype).bits // 8

    def slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        """Slot indices of positions ``[start, end)`` of a sequence with this block table."""
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]
