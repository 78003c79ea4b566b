"""Attention over a packed, paged batch, plugged into transformers' own model code.

transformers calls ``attention_interface(module, query, key, value, mask, **kwargs)`` from each
attention layer, and extra keyword arguments given to the model's forward reach it. We pass the
batch layout as ``specd_attn`` and do two things per layer: write the new K/V into the paged cache,
then attend each query token to its own sequence's cached K/V with a causal limit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from engine.kv_cache import PagedKVCache

ATTN_IMPL = "specd_paged"


@dataclass
class AttentionMetadata:
    """Layout of one packed forward. ``T`` is the total number of new tokens across sequences."""

    cache: PagedKVCache
    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V goes
    query_starts: list[int]  # [B+1] offsets of each sequence's tokens in the packed batch
    context_slots: list[torch.Tensor]  # B x [ctx_i] long: every slot the sequence attends to
    positions: list[torch.Tensor]  # B x [q_i] long: position of each query token
    causal_masks: list[torch.Tensor | None]  # B x [q_i, ctx_i] bool, None when q_i == 1

    @property
    def num_seqs(self) -> int:
        return len(self.query_starts) - 1


def build_metadata(
    cache: PagedKVCache, block_tables: list[list[int]], starts: list[int], ends: list[int], device: torch.device
) -> AttentionMetadata:
    """Sequence i feeds positions ``[starts[i], ends[i])`` and attends to ``[0, ends[i])``."""
    slot_mapping: list[int] = []
    query_starts = [0]
    context_slots, positions, masks = [], [], []
    for table, start, end in zip(block_tables, starts, ends):
        slots = cache.slots(table, 0, end)
        slot_mapping.extend(slots[start:])
        query_starts.append(query_starts[-1] + end - start)
        context_slots.append(torch.tensor(slots, dtype=torch.long, device=device))
        pos = torch.arange(start, end, device=device)
        positions.append(pos)
        # Query at position p sees keys at positions <= p (bottom-right aligned causal mask).
        masks.append(None if end - start == 1 else pos[:, None] >= torch.arange(end, device=device)[None, :])
    return AttentionMetadata(
        cache=cache,
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
        query_starts=query_starts,
        context_slots=context_slots,
        positions=positions,
        causal_masks=masks,
    )


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    specd_attn: AttentionMetadata | None = None,
    sliding_window: int | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    if specd_attn is None:
        raise RuntimeError(f"the {ATTN_IMPL!r} attention needs specd_attn metadata: run the model through ModelRunner")
    meta = specd_attn
    layer = module.layer_idx
    k_cache, v_cache = meta.cache.k[layer], meta.cache.v[layer]  # [slots, Hkv, D]
    k_cache.index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1).to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1).to(v_cache.dtype))

    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [T, H, D]
    gqa = query.shape[1] != key.shape[1]
    for i in range(meta.num_seqs):
        qs, qe = meta.query_starts[i], meta.query_starts[i + 1]
        slots = meta.context_slots[i]
        k = k_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, D]
        v = v_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, D]
        mask = meta.causal_masks[i]
        if sliding_window is not None:
            # transformers' convention: query at p sees keys in (p - window, p].
            pos = meta.positions[i]
            window = pos[:, None] - torch.arange(slots.numel(), device=pos.device)[None, :] < sliding_window
            mask = window if mask is None else mask & window
        o = F.scaled_dot_product_attention(
            query[:, :, qs:qe], k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa
        )  # [1, H, q, D]
        out[qs:qe] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None  # [1, T, H, D], no attention weights


def register() -> None:
    """Idempotent: registering replaces the same name with the same function."""
    AttentionInterface.register(ATTN_IMPL, paged_attention_forward)
