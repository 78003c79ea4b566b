"""The suffix trie with counts behind suffix decoding: engine.speculative.suffix_index."""

from __future__ import annotations

import random

import pytest

from engine.speculative.suffix_index import NONE, ROOT, Stream, SuffixIndex
from engine.speculative.suffix_native import TokenIndex


def index_of(*streams: list[int], depth: int = 24) -> SuffixIndex:
    index = SuffixIndex(depth)
    for tokens in streams:
        index.extend(Stream(), tokens)
    return index


def contents(index: SuffixIndex) -> dict[tuple[int, ...], int]:
    """Every path and its count; checks on the way that ``best`` is a most frequent child."""
    out: dict[tuple[int, ...], int] = {}
    count = index.count

    def visit(node: int, path: tuple[int, ...]) -> None:
        many = index.kids.get(node)
        kids = list(many.values()) if many is not None else [index.best[node]] if index.best[node] != NONE else []
        if node != ROOT and kids:
            assert count[index.best[node]] == max(count[k] for k in kids), path
        if node != ROOT:
            assert many is None or len(many) >= 2, "a lone child lives in best"
            assert sum(count[k] for k in kids) <= count[node], path
        for k in kids:
            out[(*path, index.token[k])] = count[k]
            visit(k, (*path, index.token[k]))

    visit(ROOT, ())
    assert len(out) == index.num_nodes
    return out


def holds(index: TokenIndex, expected: dict[tuple[int, ...], int]) -> bool:
    """Whether ``index`` holds exactly ``expected``'s paths and counts (through the interface both tries have:
    every expected path's count, and no node more than them)."""
    return index.num_nodes == len(expected) and all(index.occurrences(list(p)) == n for p, n in expected.items())


def substring_counts(streams: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for s in streams:
        for i in range(len(s)):
            for j in range(i + 1, min(i + depth, len(s)) + 1):
                counts[tuple(s[i:j])] = counts.get(tuple(s[i:j]), 0) + 1
    return counts


def test_every_substring_up_to_the_depth_is_counted_once_per_occurrence():
    rnd = random.Random(0)
    streams = [[rnd.randrange(4) for _ in range(rnd.randrange(1, 40))] for _ in range(6)]
    index = index_of(*streams, depth=5)
    assert contents(index) == substring_counts(streams, 5)


def test_growing_a_stream_piece_by_piece_equals_inserting_it_at_once():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 3, 3]
    index, stream = SuffixIndex(4), Stream()
    for i in range(0, len(tokens), 3):
        index.extend(stream, tokens[i : i + 3])
    assert contents(index) == contents(index_of(tokens, depth=4))


def test_the_longest_suffix_seen_with_a_continuation_is_matched():
    index = index_of([1, 2, 3, 4, 7, 2, 3, 5, 7, 2, 3, 5])
    node, m = index.match([9, 1, 2, 3])
    assert m == 3 and index.token[index.best[node]] == 4
    assert index.match([9, 9, 2, 3])[1] == 2
    assert index.match([9, 9, 9, 8]) == (NONE, 0)
    # A stream's own end was never seen followed by anything.
    assert index_of([1, 2, 3]).match([1, 2, 3]) == (NONE, 0)


def test_the_draft_follows_the_most_frequent_continuation():
    index = index_of([1, 2, 3, 4, 7, 2, 3, 5, 7, 2, 3, 5])
    # After [2, 3]: 5 twice, 4 once (of 3 occurrences): 5 with probability 2/3.
    tokens, score = index.draft([9, 2, 3], limit=1, min_prob=0.1)
    assert tokens == [5] and score == pytest.approx(2 / 3)


def test_a_draft_stops_below_the_probability_floor():
    # After 1: eleven different tokens once each, so the best continuation has probability 1/11 < 0.1.
    stream = [t for x in range(2, 13) for t in (1, x)]
    index = index_of(stream)
    assert index.draft([1], limit=5, min_prob=0.1) == ([], 0.0)
    assert index.draft([1], limit=5, min_prob=0.05)[0] in ([x] for x in range(2, 13))


def test_the_running_probability_multiplies_along_the_path():
    # After [5, 6]: 7 (twice) then 8 once and 9 once: 2/3, then 2/3 * 1/2.
    index = index_of([5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 1])
    tokens, score = index.draft([5, 6], limit=2, min_prob=0.1)
    assert len(tokens) == 2 and tokens[0] == 7
    assert score == pytest.approx(2 / 3 + 1 / 3)
    assert index.draft([5, 6], limit=2, min_prob=0.4)[0] == [7]


def test_the_draft_length_grows_with_the_match_length():
    long = list(range(100, 130))
    index = index_of(long)
    assert index.draft([1, 100], limit=20, min_prob=0.1)[0] == [101]  # a 1-token match: 1 token
    assert index.draft([1, 100, 101, 102], limit=20, min_prob=0.1)[0] == [103, 104, 105]
    assert index.draft([100, 101, 102], limit=2, min_prob=0.1)[0] == [103, 104]  # and the caller's limit
    assert index.draft([100, 101, 102], limit=20, min_prob=0.1, factor=2.0, offset=1.0)[0] == list(range(103, 110))
    assert index.draft([100], limit=20, min_prob=0.1, min_match=2) == ([], 0.0)


def test_a_draft_that_reaches_the_depth_goes_on_from_a_shorter_match():
    long = list(range(200, 240))
    index = index_of(long, depth=6)
    tokens, _ = index.draft(long[:5], limit=20, min_prob=0.1, factor=10.0)
    assert tokens == long[5:25]


def test_removing_a_stream_takes_its_counts_out_and_frees_its_nodes():
    rnd = random.Random(1)
    streams = [[rnd.randrange(5) for _ in range(rnd.randrange(1, 30))] for _ in range(5)]
    index = SuffixIndex(6)
    handles = []
    for s in streams:
        handles.append(Stream())
        index.extend(handles[-1], s)
    for gone in (3, 0, 4):
        index.remove(handles[gone])
    kept = [streams[i] for i in (1, 2)]
    assert contents(index) == substring_counts(kept, 6) == contents(index_of(*kept, depth=6))
    index.remove(handles[1])
    index.remove(handles[2])
    assert index.num_nodes == 0 and index.kids == {ROOT: {}}
    assert len(index.free) == len(index.count) - 1, "every node but the root is free for reuse"
    size = len(index.count)
    index.extend(Stream(), streams[0])
    assert len(index.count) == size and contents(index) == substring_counts(streams[:1], 6), "freed ids reused"
