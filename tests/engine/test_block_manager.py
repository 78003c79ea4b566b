"""BlockManager: a free list of fixed-size KV blocks. Pure Python."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def make_seq(rid="r", n=4):
    return Sequence(request_id=rid, token_ids=list(range(n)), params=SamplingParams())


def test_allocate_gives_ceil_of_tokens_over_block_size_distinct_blocks():
    bm = BlockManager(num_blocks=10, block_size=4)
    seq = make_seq()
    bm.allocate(seq, 9)  # positions 0..8 need blocks for 0-3, 4-7, 8
    assert len(seq.block_table) == 3
    assert len(set(seq.block_table)) == 3
    assert all(0 <= b < 10 for b in seq.block_table)
    assert bm.num_free_blocks == 7


@pytest.mark.parametrize(("tokens", "blocks"), [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (16, 4), (17, 5)])
def test_blocks_needed_rounds_up_to_whole_blocks(tokens, blocks):
    bm = BlockManager(num_blocks=10, block_size=4)
    assert bm.blocks_needed(make_seq(), tokens) == blocks


def test_extending_keeps_existing_blocks_and_adds_only_the_missing_ones():
    bm = BlockManager(num_blocks=10, block_size=4)
    seq = make_seq()
    bm.allocate(seq, 4)
    first = list(seq.block_table)
    assert bm.blocks_needed(seq, 5) == 1
    bm.allocate(seq, 5)
    assert seq.block_table[:1] == first
    assert len(seq.block_table) == 2
    bm.allocate(seq, 8)  # still fits in two blocks: nothing new
    assert len(seq.block_table) == 2
    assert bm.num_free_blocks == 8


def test_capacity_reserved_for_rejected_drafts_is_kept_and_reused():
    bm = BlockManager(num_blocks=10, block_size=4)
    seq = make_seq()
    bm.allocate(seq, 12)  # 4 tokens plus 8 draft slots
    table = list(seq.block_table)
    # All drafts rejected: later steps ask for fewer slots than are held. Nothing is given back.
    bm.allocate(seq, 5)
    assert seq.block_table == table
    assert bm.blocks_needed(seq, 6) == 0
    assert bm.num_free_blocks == 7
    # Growing past the held capacity appends after the kept blocks.
    bm.allocate(seq, 13)
    assert seq.block_table[:3] == table
    assert len(seq.block_table) == 4


def test_free_returns_every_block_and_empties_the_table():
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = make_seq("a"), make_seq("b")
    bm.allocate(a, 5)
    bm.allocate(b, 4)
    assert bm.num_free_blocks == 1
    held_by_a = set(a.block_table)
    bm.free(a)
    assert a.block_table == []
    assert bm.num_free_blocks == 4
    bm.free(b)
    assert bm.num_free_blocks == 6
    # Every block is allocatable again, each exactly once.
    c = make_seq("c")
    bm.allocate(c, 12)
    assert sorted(c.block_table) == list(range(6))
    assert held_by_a <= set(c.block_table)


def test_freeing_twice_does_not_duplicate_blocks_in_the_free_list():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq()
    bm.allocate(seq, 8)
    bm.free(seq)
    bm.free(seq)
    assert bm.num_free_blocks == 4


def test_live_sequences_never_share_a_block():
    bm = BlockManager(num_blocks=12, block_size=3)
    seqs = [make_seq(str(i)) for i in range(4)]
    for step in range(1, 4):
        for s in seqs:
            bm.allocate(s, 3 * step)
    all_blocks = [b for s in seqs for b in s.block_table]
    assert len(all_blocks) == len(set(all_blocks)) == 12
    assert bm.num_free_blocks == 0


def test_usage_is_the_fraction_of_blocks_in_use():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.usage == 0.0
    seq = make_seq()
    bm.allocate(seq, 6)
    assert bm.usage == pytest.approx(2 / 8)
    bm.allocate(seq, 32)
    assert bm.usage == pytest.approx(1.0)
    bm.free(seq)
    assert bm.usage == 0.0


def test_running_out_of_blocks_raises_and_allocates_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    a, b = make_seq("a"), make_seq("b")
    bm.allocate(a, 8)
    assert not bm.can_allocate(b, 5)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(b, 5)
    assert b.block_table == []
    assert bm.num_free_blocks == 1
    assert bm.can_allocate(b, 4)
    bm.allocate(b, 4)
    assert bm.num_free_blocks == 0


def test_can_allocate_counts_blocks_the_sequence_already_holds():
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = make_seq()
    bm.allocate(seq, 8)
    assert bm.can_allocate(seq, 12)  # needs one more, one is free
    assert not bm.can_allocate(seq, 13)


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (-1, 4)])
def test_constructor_rejects_empty_cache_or_block(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks=num_blocks, block_size=block_size)
