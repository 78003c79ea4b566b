"""BlockManager: a free list of fixed-size KV blocks. Pure Python."""

from __future__ import annotations

import pytest

from engine.sched.block_manager import BlockManager
from engine.types.sampling_params import SamplingParams
from engine.types.sequence import Sequence


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


# ---- prefix caching ----------------------------------------------------------------------------------


def computed(bm: BlockManager, tokens: list[int], rid: str = "s", draft: bool = False) -> Sequence:
    """A sequence that has computed all but its last token (as after a prefill), registered."""
    seq = Sequence(request_id=rid, token_ids=list(tokens), params=SamplingParams())
    bm.reuse(seq, bm.match(seq))
    bm.allocate(seq, len(tokens))
    seq.num_computed = len(tokens) - 1
    if draft:
        seq.draft_num_computed = seq.num_computed
    bm.register(seq)
    return seq


def fresh(tokens: list[int], rid: str = "new") -> Sequence:
    return Sequence(request_id=rid, token_ids=list(tokens), params=SamplingParams())


def test_a_new_sequence_reuses_the_longest_registered_chain_and_computes_the_rest():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = computed(bm, list(range(14)))  # blocks [0-3] [4-7] [8-11] full and computed; [12, 13] not
    b = fresh([*range(12), 99, 98, 97])
    hit = bm.match(b)
    assert hit == a.block_table[:3]
    bm.reuse(b, hit)
    assert b.num_computed == 12 and b.block_table == a.block_table[:3]
    assert [bm.refs(x) for x in hit] == [2, 2, 2]


def test_the_last_token_is_never_taken_from_the_cache():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = computed(bm, list(range(13)))  # three full blocks registered
    # The same 12 tokens as a prompt: the third block would leave nothing to compute, so only two are reused.
    assert bm.match(fresh(list(range(12)))) == a.block_table[:2]
    assert bm.match(fresh(list(range(13)))) == a.block_table[:3]


def test_a_block_matches_only_behind_the_same_prefix():
    bm = BlockManager(num_blocks=10, block_size=4)
    computed(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # The second block's tokens are the same, but behind a different first block: K/V differ, no hit.
    assert bm.match(fresh([0, 2, 3, 4, 5, 6, 7, 8, 9])) == []
    assert bm.match(fresh([1, 2, 3, 4, 5, 6, 7, 0, 9])) == [0]


def test_only_computed_full_blocks_are_registered():
    bm = BlockManager(num_blocks=10, block_size=4)
    seq = fresh(list(range(11)), "chunked")
    bm.allocate(seq, 11)
    seq.num_computed = 6  # a chunked prefill part-way: block 0 done, block 1 half done
    bm.register(seq)
    assert bm.num_cached_blocks == 1
    assert bm.match(fresh(list(range(11)))) == seq.block_table[:1]


def test_a_shared_block_outlives_one_reader_and_becomes_evictable_after_the_last():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = computed(bm, list(range(9)), "a")
    b = fresh(list(range(9)), "b")
    bm.reuse(b, bm.match(b))
    shared = b.block_table[:]
    bm.allocate(b, 9)
    assert bm.num_free_blocks == 6 - 3 - 1  # a holds 3 blocks, b reuses 2 of them and adds 1
    bm.free(a)
    assert [bm.refs(x) for x in shared] == [1, 1]
    assert bm.num_free_blocks == 6 - 3  # a's private third block is free again; the shared ones are b's
    bm.free(b)
    assert [bm.refs(x) for x in shared] == [0, 0]
    assert bm.num_free_blocks == 6 and bm.usage == 0.0
    assert bm.match(fresh(list(range(9)))) == shared  # still cached, nobody holding it


def test_never_used_blocks_go_first_then_the_least_recently_released_tail_first():
    bm = BlockManager(num_blocks=6, block_size=2)
    old = computed(bm, [1, 2, 3, 4, 5], "old")  # blocks 0, 1 registered, 2 private
    new = computed(bm, [7, 8, 9, 10, 11], "new")  # blocks 3, 4 registered, 5 private
    bm.free(old)
    bm.free(new)
    taker = fresh(list(range(100, 112)), "taker")
    bm.allocate(taker, 4)  # the two never-registered blocks come back first
    assert sorted(taker.block_table) == [2, 5] and bm.num_cached_blocks == 4
    bm.allocate(taker, 6)  # then eviction: the older chain, its tail before its head
    assert taker.block_table[2] == 1
    assert bm.match(fresh([1, 2, 3, 4, 5])) == [0]  # the head still serves a shorter prefix
    bm.allocate(taker, 8)
    assert taker.block_table[3] == 0
    assert bm.match(fresh([7, 8, 9, 10, 11])) == [3, 4]  # the newer chain is untouched


def test_reusing_an_unheld_cached_block_takes_it_out_of_the_evictable_pool():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.free(computed(bm, list(range(9))))  # two registered blocks, both unheld
    seq = fresh([*range(8), 50, 51, 52, 53, 54, 55, 56, 57, 58])
    hit = bm.match(seq)
    assert len(hit) == 2 and bm.num_free_blocks == 4
    # 17 positions need 5 blocks: 2 reused + 3 more, but taking the 2 leaves only 2 others.
    assert not bm.can_reuse(seq, hit, 17)
    assert bm.can_reuse(seq, hit, 16)
    bm.reuse(seq, hit)
    bm.allocate(seq, 16)
    assert bm.num_free_blocks == 0 and sorted(seq.block_table) == [0, 1, 2, 3]


def test_the_draft_cache_is_reused_only_as_far_as_blocks_a_draft_model_computed():
    bm = BlockManager(num_blocks=12, block_size=4)
    a = computed(bm, list(range(13)), "a")  # target only: say, lookup drafted this one
    b = fresh(list(range(13)), "b")
    bm.reuse(b, bm.match(b))
    assert (b.num_computed, b.draft_num_computed) == (12, 0)  # the draft model must catch up on all 12
    b.draft_num_computed = 8  # it caught up two blocks
    bm.register(b)
    c = fresh(list(range(13)), "c")
    bm.reuse(c, bm.match(c))
    assert (c.num_computed, c.draft_num_computed) == (12, 8)
    assert a.block_table[:3] == c.block_table


def test_a_block_computed_twice_at_once_stays_private_to_its_second_owner():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = fresh(list(range(9)), "a"), fresh(list(range(9)), "b")
    for s in (a, b):
        bm.allocate(s, 9)
        s.num_computed = 8
    bm.register(a)
    bm.register(b)
    assert bm.num_cached_blocks == 2
    assert bm.match(fresh(list(range(9)))) == a.block_table[:2]
    bm.free(b)  # b's duplicates were never registered: back to the free list, not the cache
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 8 - 3


def test_with_prefix_caching_off_nothing_is_registered_or_reused():
    bm = BlockManager(num_blocks=8, block_size=4, prefix_caching=False)
    bm.free(computed(bm, list(range(9))))
    assert bm.num_cached_blocks == 0 and bm.match(fresh(list(range(9)))) == []
    assert bm.num_free_blocks == 8


def test_a_preempted_sequence_keeps_its_hashes_and_finds_its_own_blocks_again():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = computed(bm, list(range(10)))
    table = seq.block_table[:2]
    bm.free(seq)
    seq.reset_for_recompute()
    assert seq.prefix.registered == 0 and len(seq.prefix.hashes) == 2
    assert bm.match(seq) == table
