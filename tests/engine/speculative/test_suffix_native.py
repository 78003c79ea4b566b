"""The C suffix trie (engine.speculative.suffix_native) against the Python one it replaces: the same counts,
the same matches and the same drafts after any interleaving of growing streams and removing them."""

from __future__ import annotations

import random

import pytest

from engine.speculative.suffix_index import SuffixIndex
from engine.speculative.suffix_native import NativeSuffixIndex, native_available, new_index
from tests.engine.speculative.test_suffix_index import holds, substring_counts


def test_the_c_trie_builds_here():
    # CI and every supported host have a C compiler (the CPU attention kernel needs one too): the fast trie is
    # the one in use, not the fallback.
    assert native_available()
    assert isinstance(new_index(24), NativeSuffixIndex)


def same_answers(rnd: random.Random, py: SuffixIndex, c: NativeSuffixIndex, streams: list[list[int]],
                 vocab: int) -> None:
    assert c.num_nodes == py.num_nodes
    for s in streams:
        for i in range(len(s)):
            path = s[i : i + rnd.randrange(1, py.depth + 1)]
            assert c.occurrences(path) == py.occurrences(path), path
    for _ in range(30):
        if streams and rnd.random() < 0.7:  # mostly contexts that end inside what was inserted
            s = rnd.choice(streams)
            context = [rnd.randrange(vocab) for _ in range(rnd.randrange(3))] + s[: rnd.randrange(1, len(s) + 1)]
        else:
            context = [rnd.randrange(vocab) for _ in range(rnd.randrange(1, 12))]
        assert c.match(context)[1] == py.match(context)[1], context
        limit, min_prob = rnd.randrange(0, 30), rnd.choice([0.0, 0.05, 0.1, 0.3, 0.6])
        factor, offset, min_match = rnd.choice([1.0, 2.0, 4.0]), rnd.choice([0.0, 1.0]), rnd.randrange(1, 3)
        want = py.draft(context, limit, min_prob, factor, offset, min_match)
        got = c.draft(context, limit, min_prob, factor, offset, min_match)
        assert got[0] == want[0] and got[1] == pytest.approx(want[1], rel=0, abs=0), (context, limit, min_prob)


@pytest.mark.parametrize("seed", range(40))
def test_the_c_trie_answers_as_the_python_one_through_growth_and_removal(seed: int):
    rnd = random.Random(seed)
    depth, vocab = rnd.randrange(2, 9), rnd.choice([2, 3, 5, 40])
    py, c = SuffixIndex(depth), NativeSuffixIndex(depth)
    live: list[tuple[list[int], object, object]] = []  # (tokens, python stream, c stream)
    for _ in range(rnd.randrange(4, 14)):
        if live and rnd.random() < 0.3:
            tokens, ps, cs = live.pop(rnd.randrange(len(live)))
            py.remove(ps)
            c.remove(cs)
        elif live and rnd.random() < 0.5:  # a stream grows piece by piece, as a request's output does
            tokens, ps, cs = rnd.choice(live)
            more = [rnd.randrange(vocab) for _ in range(rnd.randrange(1, 9))]
            py.extend(ps, more)
            c.extend(cs, more)
            tokens.extend(more)
        else:
            tokens = [rnd.randrange(vocab) for _ in range(rnd.randrange(1, 40))]
            ps, cs = py.stream(), c.stream()
            py.extend(ps, tokens)
            c.extend(cs, tokens)
            live.append((tokens, ps, cs))
        streams = [t for t, _, _ in live]
        same_answers(rnd, py, c, streams, vocab)
        assert holds(c, substring_counts(streams, depth))


def test_removing_every_stream_empties_the_c_trie_and_its_ids_are_reused():
    rnd = random.Random(7)
    c = NativeSuffixIndex(6)
    streams = []
    for _ in range(20):
        s = c.stream()
        c.extend(s, [rnd.randrange(50) for _ in range(300)])
        streams.append(s)
    for s in streams:
        c.remove(s)
    assert c.num_nodes == 0 and all(len(s) == 0 for s in streams)
    emptied = c.nbytes
    s = c.stream()
    c.extend(s, [rnd.randrange(50) for _ in range(300)])
    assert c.nbytes == emptied, "a trie refilled after removals reuses its freed ids instead of growing"
    assert holds(c, substring_counts([s.tokens], 6))


def test_a_long_stream_is_inserted_and_drafts_past_the_depth():
    long = list(range(1000, 1400))
    c = NativeSuffixIndex(24)
    c.extend(c.stream(), long)
    tokens, score = c.draft(long[:30], limit=200, min_prob=0.1, factor=10.0)
    assert tokens == long[30:230] and score == pytest.approx(200.0)
