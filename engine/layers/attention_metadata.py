"""The layout of one packed forward, as attention reads it: where each new token's K/V goes, each token's
position, and how the queries are grouped (short queries padded together, long ones alone, or a static
bucket's fixed shapes). engine.worker.layout builds it; engine.layers.attention reads it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TypeVar

import torch
from torch.nn.attention.flex_attention import BlockMask

from engine.layers.kv_cache import PagedKVCache

SHORT_QUERY = 32  # sequences feeding at most this many tokens share one padded attention call


@dataclass(frozen=True)
class ShortGroup:
    """Sequences with short queries, padded to ``[G, Q]`` queries over ``[G, C]`` keys."""

    # rows, real and real_rows: None when every sequence is here with exactly Q tokens (the queries are the
    # packed rows, reshaped: no padding)
    rows: torch.Tensor | None  # [G, Q] long: each query's row in the packed batch (padding repeats a row)
    real: torch.Tensor | None  # [N] long: the real queries' flat indices in [G * Q] (no boolean-mask indexing)
    real_rows: torch.Tensor | None  # [N] long: their rows in the packed batch
    positions: torch.Tensor  # [G, Q] long, 0 for padding queries
    slots: torch.Tensor | None  # [G, C] long: cache slot of key position c (None: read ``span``, never on the CPU)
    mask: torch.Tensor | None  # [G, 1, Q, C] bool: causal, padding rows see key 0 only (no NaN rows)
    span: tuple[int, int] | None  # one sequence whose slots are one contiguous range: read a view


@dataclass(frozen=True)
class LongSeq:
    rows: slice  # this sequence's rows in the packed batch
    fresh: bool  # the whole context is this step's tokens: use them without a cache gather
    slots: torch.Tensor  # [C] long
    positions: torch.Tensor  # [q] long
    mask: torch.Tensor  # [q, C] bool, causal with the queries at the end


@dataclass(frozen=True)
class AttentionMetadata:
    """Layout of one packed forward of ``T`` new tokens."""

    cache: PagedKVCache
    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V goes
    positions: torch.Tensor  # [T] long: each new token's position in its sequence
    short: ShortGroup | None
    long: list[LongSeq]
    # Copies for the other devices of a model split across devices, made on first use in this forward.
    replicas: dict[torch.device, AttentionMetadata] = field(default_factory=dict, init=False, repr=False, compare=False)

    def on(self, device: torch.device) -> AttentionMetadata:
        """This layout with its index tensors on ``device``, where a split model's layer (and that
        layer's cache) runs. The unsplit case returns ``self``."""
        if device == self.slot_mapping.device:
            return self
        replica = self.replicas.get(device)
        if replica is None:
            short = _moved(self.short, device) if self.short is not None else None
            replica = replace(_moved(self, device), short=short, long=[_moved(s, device) for s in self.long])
            self.replicas[device] = replica
        return replica


@dataclass(frozen=True)
class PaddedMetadata:
    """A forward of ``G x Q`` tokens (sequence g's token j at row g * Q + j) over ``C`` key positions,
    shapes fixed by the bucket. Padding tokens write the cache's scratch slot and repeat their
    sequence's last real position, so their queries see only real keys and never change a real row."""

    cache: PagedKVCache
    slot_mapping: torch.Tensor  # [G * Q] long
    positions: torch.Tensor  # [G, Q] long
    key_slots: torch.Tensor  # [G, C] long: cache slot of key position c, through the block table
    mask: torch.Tensor  # [G, 1, Q, C] bool: key position <= query position (keys past a context are masked)
    paged: PagedMask | None = None  # set: attend through the block table with FlexAttention instead

    def on(self, device: torch.device) -> PaddedMetadata:
        if device != self.slot_mapping.device:
            raise RuntimeError("static-shape forwards run on one device (engine.worker.graphs is off for split models)")
        return self


@dataclass(frozen=True)
class PagedMask:
    """FlexAttention over the whole cache as one key sequence (slot s is key index s): sequence g's
    block mask lists its own blocks, in table order, so the kernel reads nothing else; ``logical``
    turns a visited slot back into a position for the causal (and sliding-window) test."""

    block_mask: BlockMask  # batch G, one query block, kv_indices = block tables
    logical: torch.Tensor  # [G, num_blocks + 1] int32: physical block -> its index in sequence g's table
    positions: torch.Tensor  # [G, Q_max] long: the queries' positions, zero past the bucket's


_Layout = TypeVar("_Layout", "AttentionMetadata", ShortGroup, LongSeq)


def _moved(obj: _Layout, device: torch.device) -> _Layout:
    """A copy of a layout dataclass with its tensor fields on ``device``."""
    values = {f.name: getattr(obj, f.name) for f in fields(obj) if f.init}
    return replace(obj, **{k: v.to(device) for k, v in values.items() if isinstance(v, torch.Tensor)})
