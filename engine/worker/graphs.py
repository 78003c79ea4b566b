"""Decode and verify forwards in static shapes: padded to buckets, replayed as CUDA graphs.

A forward whose sequences all feed few tokens (a decode step, a verify step, a draft position) is
padded to the smallest bucket of G sequences x Q tokens over C key positions that holds it. Its
layout lives in persistent device buffers that each forward overwrites with one host-to-device
copy from pinned staging memory; nothing is read back. On CUDA each bucket's forward is captured
once as a CUDA graph and replayed: one launch per forward instead of one per kernel, and no
Python per layer. On CPU the same padded forward runs eagerly (there are no graphs), which is how
the CPU tests pin down that padding never changes an output. Prefill chunks and forwards larger
than every bucket keep the eager path (``ModelRunner.forward``), with the same result.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from engine.layers import attention, attention_metadata
from engine.layers.kv_cache import PagedKVCache

logger = logging.getLogger(__name__)

MIN_CONTEXT = 256  # the smallest context bucket: gathering a few hundred keys costs little beside the weights
# The largest: the padded gather of a 64 x 4096 bucket is already ~1 GB per layer for an 8B model (and held in
# the graphs' memory pool), and a model with a 128k limit would otherwise capture buckets no cache can fill.
# Longer contexts run eagerly.
MAX_CONTEXT = 4096
_STAGING = 8  # pinned staging buffers in rotation: a draft loop queues several forwards without a sync


@dataclass(frozen=True, order=True)
class Bucket:
    batch: int  # G sequences
    query: int  # Q tokens each
    context: int  # C key positions, a multiple of the block size


def _up_to(limit: int, seeds: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted({s for s in seeds if s < limit} | {limit}))


@dataclass(frozen=True)
class Buckets:
    batch: tuple[int, ...]
    query: tuple[int, ...]
    context: tuple[int, ...]

    @staticmethod
    def for_limits(
        max_num_seqs: int, k_max: int, max_model_len: int, block_size: int, min_context: int = MIN_CONTEXT,
        max_context: int = MAX_CONTEXT,
    ) -> Buckets:
        """Batch 1, 2, 4, 8, then every 16 (vLLM's spacing: padding wastes at most 15 rows); queries 1,
        2, 4, 8 up to a full verify of k_max drafts; contexts doubling from ``min_context`` up to the
        longest a verify can reach (max_model_len plus drafts, as the KV sizing counts it), at most
        ``max_context`` (rounded up to whole blocks)."""
        batch = _up_to(max_num_seqs, (1, 2, 4, 8, *range(16, max_num_seqs, 16)))
        query = _up_to(k_max + 1, (1, 2, 4, 8, 16))
        longest = -(-(max_model_len + k_max + 1) // block_size) * block_size
        longest = min(longest, -(-max_context // block_size) * block_size)
        first = -(-min(min_context, longest) // block_size) * block_size
        context, c = [], first
        while c < longest:
            context.append(c)
            c *= 2
        return Buckets(batch, query, (*context, longest))

    def pick(self, batch: int, query: int, context: int) -> Bucket | None:
        """The smallest bucket holding the forward; None when it fits none (it then runs eagerly)."""
        sizes = [next((v for v in vs if v >= n), None)
                 for vs, n in ((self.batch, batch), (self.query, query), (self.context, context))]
        return None if None in sizes else Bucket(*sizes)  # type: ignore[arg-type]

    def all(self) -> list[Bucket]:
        return [Bucket(g, q, c) for g in self.batch for q in self.query for c in self.context]


class StaticForward:
    """Runs one model's short-query forwards in bucket shapes; ``capture``: as CUDA graphs."""

    def __init__(
        self, model: torch.nn.Module, cache: PagedKVCache, buckets: Buckets, device: torch.device, name: str,
        call: Callable[..., Any] | None = None, paged_kernel: bool = False,
    ) -> None:
        """``call``: what runs the model (a torch.compile'd one, whose kernels the graphs then capture).
        ``paged_kernel``: attention reads the cache through the block table (FlexAttention) instead of
        gathering each sequence's keys into a padded copy."""
        self.cache, self.buckets, self.name = cache, buckets, name
        self.call = model if call is None else call
        self.device = device
        self.capture = device.type == "cuda"
        self.block_size = cache.block_size
        self.G, self.Q = max(buckets.batch), max(buckets.query)
        self.NB = max(buckets.context) // self.block_size
        GQ = self.G * self.Q
        # One flat int64 buffer, sections at fixed offsets (a captured graph reads fixed addresses):
        # token ids, positions, slot mapping, packed row -> padded row, logits rows, block tables.
        self._off = {name: i * GQ for i, name in enumerate(("ids", "pos", "slots", "real", "keep"))}
        self._off["tables"] = 5 * GQ
        size = 5 * GQ + self.G * self.NB
        self.buf = torch.zeros(size, dtype=torch.long, device=device)
        pin = self.capture
        self._staging = [torch.zeros(size, dtype=torch.long, pin_memory=pin) for _ in range(_STAGING)]
        self._copied: list[torch.cuda.Event | None] = [None] * _STAGING
        self._turn = 0
        vocab = model.config.get_text_config().vocab_size  # the LM head's width (an exit head's too)
        # Every bucket writes its logits here, so the graphs share one output instead of holding one each.
        self.logits = torch.zeros(GQ, vocab, dtype=torch.float32, device=device)
        self.graphs: dict[Bucket, torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.replays = 0  # forwards run in a bucket (graph replays on CUDA)
        self.paged_kernel = paged_kernel
        if paged_kernel:
            # One sparse query block spans every query of a sequence. FlexAttention's short-query kernel tiles
            # (queries x query heads per KV head) rows by a power of two that must divide it: 1024 covers 16
            # queries of a group of 64 heads.
            self._query_block = 1024
            # Per sequence: the block mask's block list (its blocks, then unused columns; on CPU the blocks every
            # query sees whole are listed apart, in _full_indices) and the inverse map physical block -> index
            # in the table, one column past the blocks for entries past the table.
            self._kv_indices = torch.zeros(self.G, 1, 1, cache.num_blocks, dtype=torch.int32, device=device)
            self._full_indices = torch.zeros_like(self._kv_indices) if device.type == "cpu" else None
            self._logical = torch.zeros(self.G, cache.num_blocks + 1, dtype=torch.int32, device=device)

    def _section(self, name: str, n: int) -> torch.Tensor:
        return self.buf[self._off[name] : self._off[name] + n]

    def _tables(self, bucket: Bucket) -> torch.Tensor:
        full = self.buf[self._off["tables"] :].view(self.G, self.NB)
        return full[: bucket.batch, : bucket.context // self.block_size]  # [G, C / block_size]

    def fits(self, q_lens: list[int], ends: list[int]) -> Bucket | None:
        if min(q_lens) < 1:
            return None
        return self.buckets.pick(len(q_lens), max(q_lens), max(ends))

    def _body(self, b: Bucket) -> None:
        """The forward of bucket ``b`` on whatever the buffers hold; logits land in ``self.logits``."""
        T, bs = b.batch * b.query, self.block_size
        ids, positions = self._section("ids", T), self._section("pos", T)
        kpos = torch.arange(b.context, device=self.device)  # [C]
        key_slots = self._tables(b).index_select(1, kpos // bs) * bs + kpos % bs  # [G, C]
        qpos = positions.view(b.batch, b.query)  # [G, Q]
        mask = (kpos[None, None, :] <= qpos[:, :, None])[:, None]  # [G, 1, Q, C]
        paged = self._paged_mask(b, qpos) if self.paged_kernel else None
        meta = attention_metadata.PaddedMetadata(self.cache, self._section("slots", T), qpos, key_slots, mask, paged)
        out = self.call(input_ids=ids[None], position_ids=positions[None], use_cache=False,
                         **{attention.METADATA_KWARG: meta})
        self.logits[:T].copy_(out.logits[0])  # [T, V], float32

    def _paged_mask(self, b: Bucket, qpos: torch.Tensor) -> attention_metadata.PagedMask:
        """The block mask of bucket ``b``'s sequences over the whole cache, from the block tables on the device.
        Queries are laid out to the largest query bucket (rows past ``b.query`` are discarded), so flex_attention
        compiles one shape per batch bucket."""
        G, bs, n = b.batch, self.block_size, self.cache.num_blocks
        tables = self._tables(b)  # [G, NB]
        NB = tables.shape[1]
        used = qpos.amax(1) // bs + 1  # [G] blocks holding positions 0 .. the last query's
        j = torch.arange(NB, device=self.device)  # [NB]
        # Only the blocks in use get their entry: a stale table entry past them may name one of them.
        column = torch.where(j[None] < used[:, None], tables, n)  # [G, NB]
        logical = self._logical[:G]
        logical.scatter_(1, column, j.to(torch.int32).expand(G, -1))
        positions = F.pad(qpos, (0, self.Q - b.query))  # [G, Q_max]

        def causal(batch, head, q_idx, kv_idx):  # noqa: ANN001, ANN202
            return logical[batch, kv_idx // bs] * bs + kv_idx % bs <= positions[batch, q_idx]

        kv_indices = self._kv_indices[:G]
        if self.device.type == "cuda":
            # Every block through the mask: given "full" blocks, the CUDA short-query kernel splits its work by
            # the whole key length (here the whole cache) and leaves most of its thread blocks idle.
            kv_indices[:, 0, 0, :NB].copy_(tables)
            counts = used.to(torch.int32).view(G, 1, 1)
            full_counts = full_indices = None
        else:
            # The CPU kernel fails to compile without full blocks: those wholly before the first query.
            full = (qpos.amin(1) + 1) // bs  # [G]
            assert self._full_indices is not None
            full_indices = self._full_indices[:G]
            full_indices[:, 0, 0, :NB].copy_(tables)
            kv_indices[:, 0, 0, :NB].copy_(tables.gather(1, (full[:, None] + j).clamp(max=NB - 1)))
            counts, full_counts = (used - full).to(torch.int32).view(G, 1, 1), full.to(torch.int32).view(G, 1, 1)
        block_mask = BlockMask.from_kv_blocks(
            counts, kv_indices, full_counts, full_indices, BLOCK_SIZE=(self._query_block, bs), mask_mod=causal,
            seq_lengths=(self.Q, n * bs), compute_q_blocks=False)
        return attention_metadata.PagedMask(block_mask, logical, positions)

    def capture_bucket(self, b: Bucket) -> float:
        """Capture ``b``'s graph (CUDA only); seconds taken. The buffers are first set to a harmless
        layout (every write to the scratch slot), since the warm-up forward really runs."""
        t0 = time.perf_counter()
        if not self.capture or b in self.graphs:
            return 0.0
        with torch.inference_mode():
            self._capture(b)
        return time.perf_counter() - t0

    def _capture(self, b: Bucket) -> None:
        self.buf.zero_()
        self._section("slots", self.G * self.Q).fill_(self.cache.scratch_slot)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # first run: cuBLAS handles and workspaces exist before capture
            self._body(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._body(b)
        self.graphs[b] = graph

    def capture_all(self) -> float:
        """Capture every bucket at start-up, largest first (smaller ones then fit in the pool's memory),
        logging progress; seconds taken."""
        if not self.capture:
            return 0.0
        todo = sorted(self.buckets.all(), reverse=True)
        t0, last = time.perf_counter(), time.perf_counter()
        for i, b in enumerate(todo, 1):
            self.capture_bucket(b)
            if time.perf_counter() - last > 5 or i == len(todo):
                last = time.perf_counter()
                logger.info("capturing CUDA graphs of %s: %d/%d buckets, %.1fs", self.name, i, len(todo), last - t0)
        return time.perf_counter() - t0

    def _stage(self, b: Bucket, token_ids: list[list[int]], starts: list[int], block_tables: list[list[int]],
               logits_rows: list[int]) -> int:
        """Write the forward's layout into the next staging buffer and copy it to the device; the
        number of logits rows."""
        turn = self._turn = (self._turn + 1) % _STAGING
        done = self._copied[turn]
        if done is not None:
            done.synchronize()  # that copy was queued _STAGING forwards ago: long finished in practice
        host = self._staging[turn]
        h = host.numpy()
        Q, bs, scratch = b.query, self.block_size, self.cache.scratch_slot
        T = b.batch * Q
        ids, pos, slots = np.zeros(T, np.int64), np.zeros(T, np.int64), np.full(T, scratch, np.int64)
        real, keep = [], []
        tables = h[self._off["tables"] :].reshape(self.G, self.NB)
        for g, (toks, start, table, rows) in enumerate(zip(token_ids, starts, block_tables, logits_rows)):
            n, base = len(toks), g * Q
            p = np.arange(start, start + n)
            tab = np.asarray(table, dtype=np.int64)
            ids[base : base + n] = toks
            pos[base : base + n] = p
            pos[base + n : base + Q] = start + n - 1  # padding repeats the last real position
            slots[base : base + n] = tab[p // bs] * bs + p % bs
            # Blocks past the largest bucket hold no key a bucketed forward reads; entries past the table are
            # stale but valid block ids, and masked.
            tables[g, : min(len(table), self.NB)] = tab[: self.NB]
            real.extend(range(base, base + n))
            keep.extend(range(base + n - rows, base + n))
        for name, values in (("ids", ids), ("pos", pos), ("slots", slots), ("real", real), ("keep", keep)):
            h[self._off[name] : self._off[name] + len(values)] = values
        self.buf.copy_(host, non_blocking=True)
        if self.capture:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._copied[turn] = event
        return len(keep)

    def forward(self, b: Bucket, token_ids: list[list[int]], starts: list[int], block_tables: list[list[int]],
                logits_rows: list[int], input_ids: torch.Tensor | None) -> torch.Tensor:
        """Float32 logits ``[sum(logits_rows), vocab]``, rows in ``ModelRunner.forward``'s order."""
        if self.capture and b not in self.graphs:
            seconds = self.capture_bucket(b)
            logger.info("captured a CUDA graph of %s for %s in %.2fs", self.name, b, seconds)
        R = self._stage(b, token_ids, starts, block_tables, logits_rows)
        if input_ids is not None:  # tokens already on the device (the draft loop's last output)
            ids = self.buf[self._off["ids"] : self._off["ids"] + b.batch * b.query]
            ids.index_copy_(0, self._section("real", input_ids.numel()), input_ids.view(-1))
        if self.capture:
            self.graphs[b].replay()
        else:
            self._body(b)
        self.replays += 1
        # A fresh tensor: the next forward overwrites self.logits.
        return self.logits.index_select(0, self._section("keep", R))  # [R, V]
