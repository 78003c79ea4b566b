"""The host side of a packed forward's layout: which rows, positions and cache slots each sequence has,
built as plain Python and sent to the device in one copy (engine.worker.staging.Uploader); engine.layers.attention reads
the ``AttentionMetadata`` assembled from it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engine.layers.attention_metadata import SHORT_QUERY, AttentionMetadata, LongSeq, ShortGroup
from engine.layers.kv_cache import PagedKVCache
from engine.worker.staging import Uploader


@dataclass(frozen=True)
class ShortPlan:
    """The host facts of the short group (its index values travel in ``HostLayout.values``)."""

    batch: int  # G
    query: int  # Q
    context: int  # C
    trivial: bool  # one query per sequence over equal contexts: no mask
    span: tuple[int, int] | None


@dataclass(frozen=True)
class LongPlan:
    rows: slice
    fresh: bool


@dataclass(frozen=True)
class HostLayout:
    """A packed forward's layout as plain Python: ``values`` (name -> flat ints and their shape) go to the device
    in one copy (engine.worker.staging.Uploader) beside whatever else the forward sends, and ``metadata`` assembles the
    layout there. Everything of size T or G x Q is built here; what grows with the context (the [G, C] key slots,
    the mask) is built on the device from the block tables and positions, a few whole-tensor ops."""

    values: dict[str, tuple[list[int], tuple[int, ...]]]
    short: ShortPlan | None
    long: list[LongPlan]
    block_size: int

    def metadata(self, cache: PagedKVCache, t: dict[str, torch.Tensor], upload: Uploader) -> AttentionMetadata:
        """``t``: at least ``values``, as tensors on the device; ``upload`` lends its persistent ``arange``."""
        short = None
        if (s := self.short) is not None:
            qpos = t["short.positions"]  # [G, Q]
            kpos = upload.arange(s.context)  # [C]
            slots = None
            if s.span is None:
                bs = self.block_size
                # Block b of the table holds key positions [b * bs, (b + 1) * bs).
                slots = (t["short.tables"][:, :, None] * bs + upload.arange(bs)).view(s.batch, -1)[:, : s.context]
                slots = slots.contiguous()  # [G, C]
            elif cache.devices[0].type == "cpu":
                # The CPU kernel (engine.layers.cpu_attention) reads a span faster than SDPA reads its view (1.6x
                # at one query, 2x at four): every thread takes a share of the keys, and no mask is read.
                slots = (upload.arange(s.context) + s.span[0])[None]  # [1, C]
            # Query at position p sees keys at positions <= p; keys past a sequence's own context all have
            # positions beyond its last query, so the same comparison masks the padding.
            mask = None if s.trivial else (kpos <= qpos[:, :, None])[:, None]  # [G, 1, Q, C]
            short = ShortGroup(t.get("short.rows"), t.get("short.real"), t.get("short.real_rows"), qpos, slots, mask,
                               s.span)
        long = []
        for i, plan in enumerate(self.long):
            slots, qpos = t[f"long{i}.slots"], t[f"long{i}.positions"]  # [C], [q]
            mask = upload.arange(slots.shape[0])[None, :] <= qpos[:, None]  # [q, C]
            long.append(LongSeq(t.get(f"long{i}.rows", plan.rows), plan.fresh, slots, qpos, mask))
        return AttentionMetadata(cache, t["slot_mapping"], t["positions"], short, long)


def plan_layout(block_tables: list[list[int]], starts: list[int], ends: list[int], block_size: int) -> HostLayout:
    """The host side of a forward's layout: sequence i feeds positions ``[starts[i], ends[i])`` and attends to
    ``[0, ends[i])``. Plain lists, no tensor and no numpy: a step's host code runs with its caches cold (the
    forward before it streamed the weights through them), where numpy's per-call machinery measured 4x slower
    than its warm microbenchmark and list comprehensions under 2x."""
    bs, B = block_size, len(starts)
    q_lens = [e - s for s, e in zip(starts, ends)]
    first = [0, *itertools.accumulate(q_lens)]  # each sequence's first packed row
    T = first[-1]
    positions: list[int] = []
    slot_mapping: list[int] = []
    for table, s, e in zip(block_tables, starts, ends):
        positions += range(s, e)
        slot_mapping += [table[p // bs] * bs + p % bs for p in range(s, e)]
    values = {"slot_mapping": (slot_mapping, (T,)), "positions": (positions, (T,))}
    idx = [i for i in range(B) if q_lens[i] <= SHORT_QUERY]
    short = None
    if idx:
        G, Q, C = len(idx), max(q_lens[i] for i in idx), max(ends[i] for i in idx)
        dense = G == B and all(q_lens[i] == Q for i in idx)
        span = _contiguous_span(block_tables[idx[0]], C, bs) if G == 1 else None
        qpos: list[int] = []
        for i in idx:  # padding queries sit at position 0: the causal test lets them see key 0 alone (no NaN row)
            qpos += range(starts[i], ends[i])
            qpos += [0] * (Q - q_lens[i])
        values["short.positions"] = (qpos, (G, Q))
        if not dense:
            values["short.rows"] = ([min(first[i] + j, T - 1) for i in idx for j in range(Q)], (G, Q))
            values["short.real"] = ([g * Q + j for g, i in enumerate(idx) for j in range(q_lens[i])], (-1,))
            values["short.real_rows"] = ([first[i] + j for i in idx for j in range(q_lens[i])], (-1,))
        if span is None:
            nb = -(-C // bs)
            values["short.tables"] = ([b for i in idx for b in (block_tables[i] + [0] * nb)[:nb]], (G, nb))
        trivial = Q == 1 and min(ends[i] for i in idx) == C
        short = ShortPlan(G, Q, C, trivial, span)
    long = []
    n_long = B - len(idx)
    for i in range(B):
        if q_lens[i] <= SHORT_QUERY:
            continue
        table = block_tables[i]
        values[f"long{len(long)}.slots"] = ([table[p // bs] * bs + p % bs for p in range(ends[i])], (-1,))
        values[f"long{len(long)}.positions"] = (list(range(starts[i], ends[i])), (-1,))
        if n_long == 1:
            # The one prompt chunk a compiled graph takes (engine.worker.prompt_layouts): its rows as an index
            # tensor, not LongSeq's slice, whose ends a graph holds as constants (one graph per prompt length).
            values["long0.rows"] = (list(range(first[i], first[i + 1])), (-1,))
        long.append(LongPlan(slice(first[i], first[i + 1]), starts[i] == 0))
    return HostLayout(values, short, long, bs)


def build_metadata(
    cache: PagedKVCache, block_tables: list[list[int]], starts: list[int], ends: list[int], upload: Uploader,
) -> AttentionMetadata:
    """Sequence i feeds positions ``[starts[i], ends[i])`` and attends to ``[0, ends[i])``. ``upload``: the
    runner's own (on CUDA it reuses pinned buffers)."""
    layout = plan_layout(block_tables, starts, ends, cache.block_size)
    return layout.metadata(cache, upload(layout.values), upload)


def _contiguous_span(table: list[int], length: int, block_size: int) -> tuple[int, int] | None:
    """(first slot, length) when positions [0, length) sit in consecutive blocks. Blocks come off
    the free list in order, so at batch 1 this is the usual case and the K/V read is a free view."""
    used = -(-length // block_size)
    first = table[0]
    return (first * block_size, length) if table[:used] == list(range(first, first + used)) else None
