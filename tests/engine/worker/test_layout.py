"""The host-built layout of a packed forward: every index the attention reads agrees with the cache's own
slot arithmetic, padding never reaches a real row, and the optional parts appear exactly when needed."""

from __future__ import annotations

import random

import torch

from engine.layers.attention_metadata import SHORT_QUERY
from engine.layers.kv_cache import LayerShape, PagedKVCache
from engine.worker.layout import build_metadata, plan_layout
from engine.worker.staging import Uploader

BS = 4
CPU = torch.device("cpu")


def _cache(num_blocks: int = 64) -> PagedKVCache:
    return PagedKVCache([LayerShape(2, 8, 8)], num_blocks=num_blocks, block_size=BS, dtype=torch.float32, device=CPU)


def _tables(rng: random.Random, ends: list[int], num_blocks: int) -> list[list[int]]:
    """Disjoint, shuffled block tables (not contiguous, so the short group gathers)."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for e in ends:
        n = -(-e // BS)
        tables.append(free[:n])
        free = free[n:]
    return tables


def test_random_mixed_batches_index_exactly_the_cache_slots_of_each_sequence():
    rng = random.Random(0)
    cache = _cache()
    for _ in range(30):
        B = rng.randint(1, 5)
        q_lens = [rng.choice([1, 1, 2, 5, SHORT_QUERY + 3]) for _ in range(B)]
        starts = [rng.randint(0, 20) for _ in range(B)]
        ends = [s + q for s, q in zip(starts, q_lens)]
        tables = _tables(rng, ends, cache.num_blocks)
        meta = build_metadata(cache, tables, starts, ends, Uploader(CPU))

        want_slots = [x for t, s, e in zip(tables, starts, ends) for x in cache.slots(t, s, e)]
        assert meta.slot_mapping.tolist() == want_slots
        assert meta.positions.tolist() == [p for s, e in zip(starts, ends) for p in range(s, e)]
        first = [sum(q_lens[:i]) for i in range(B)]

        short = [i for i in range(B) if q_lens[i] <= SHORT_QUERY]
        g = meta.short
        assert (g is None) == (not short)
        if g is not None:
            G, Q = g.positions.shape
            assert G == len(short) and Q == max(q_lens[i] for i in short)
            C = max(ends[i] for i in short)
            for row, i in enumerate(short):
                q = q_lens[i]
                assert g.positions[row, :q].tolist() == list(range(starts[i], ends[i]))
                assert g.positions[row, q:].eq(0).all(), "padding queries sit at position 0"
                if g.span is None:
                    assert g.slots is not None
                    assert g.slots[row, : ends[i]].tolist() == cache.slots(tables[i], 0, ends[i])
                if g.mask is not None:
                    kpos = torch.arange(C)
                    assert torch.equal(g.mask[row, 0, :q], kpos[None] <= g.positions[row, :q, None])
                    assert g.mask[row, 0, q:, 0].all() and not g.mask[row, 0, q:, 1:].any(), "padding sees key 0"
            if g.rows is None:
                assert all(q_lens[i] == Q for i in short) and len(short) == B
            else:
                assert g.real is not None and g.real_rows is not None
                real = [row * Q + j for row, i in enumerate(short) for j in range(q_lens[i])]
                assert g.real.tolist() == real
                assert g.real_rows.tolist() == [first[i] + j for i in short for j in range(q_lens[i])]
                # a real query reads its own packed row
                assert g.rows.view(-1)[g.real].tolist() == g.real_rows.tolist()

        long = [i for i in range(B) if q_lens[i] > SHORT_QUERY]
        assert len(meta.long) == len(long)
        for s, i in zip(meta.long, long):
            # A lone long sequence's rows are an index tensor (a compiled prompt graph takes it), others' a slice.
            rows = s.rows.tolist() if len(long) == 1 else list(range(first[i] + q_lens[i]))[s.rows]
            assert rows == list(range(first[i], first[i] + q_lens[i]))
            assert s.fresh == (starts[i] == 0)
            assert s.slots.tolist() == cache.slots(tables[i], 0, ends[i])
            assert torch.equal(s.mask, torch.arange(ends[i])[None] <= s.positions[:, None])


def test_one_sequence_in_consecutive_blocks_reads_a_span_and_needs_no_mask_to_decode():
    layout = plan_layout([[5, 6, 7]], [9], [10], BS)
    assert layout.short is not None
    assert layout.short.span == (5 * BS, 10)
    assert layout.short.trivial, "one query over its whole context: no mask"
    assert "short.tables" not in layout.values and "short.rows" not in layout.values

    verify = plan_layout([[5, 6, 7]], [7], [10], BS)
    assert verify.short is not None and not verify.short.trivial, "several queries: causal mask"

    gathered = plan_layout([[5, 9, 7]], [9], [10], BS)
    assert gathered.short is not None and gathered.short.span is None and "short.tables" in gathered.values


def test_equal_decode_queries_are_the_packed_rows_reshaped():
    layout = plan_layout([[0, 1], [3, 2]], [5, 6], [7, 8], BS)
    assert layout.short is not None and (layout.short.batch, layout.short.query) == (2, 2)
    assert "short.rows" not in layout.values, "no padding: the rows are a reshape"
    unequal = plan_layout([[0, 1], [3, 2]], [5, 7], [7, 8], BS)
    assert "short.rows" in unequal.values
    rows, _ = unequal.values["short.rows"]
    assert rows == [0, 1, 2, 2], "padding repeats the last packed row (any real row would do)"
