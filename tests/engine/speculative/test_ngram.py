"""Prompt lookup: engine.speculative.ngram.lookup and the drafter around it."""

from __future__ import annotations

import random

from engine.speculative.ngram import BULK, LookupSource, NgramIndex, lookup
from engine.speculative.source import DraftRequest
from engine.types.sampling_params import SamplingParams
from engine.types.sequence import Sequence


def test_longest_matching_n_is_tried_first():
    #        the 2-gram [1, 2] occurred at 0 (then 3); the 1-gram [2] more recently at 4 (then 4)
    tokens = [1, 2, 3, 9, 2, 4, 1, 2]
    assert lookup(tokens, n_max=2, n_min=1, k=1) == [3]
    assert lookup(tokens, n_max=1, n_min=1, k=1) == [4]


def test_most_recent_earlier_occurrence_is_used():
    tokens = [1, 2, 7, 5, 1, 2, 8, 5, 1, 2]
    assert lookup(tokens, n_max=2, n_min=1, k=1) == [8]


def test_returns_up_to_k_following_tokens():
    tokens = [1, 2, 7, 8, 9, 6, 1, 2]
    assert lookup(tokens, n_max=2, n_min=1, k=3) == [7, 8, 9]
    assert lookup(tokens, n_max=2, n_min=1, k=1) == [7]
    # The continuation may run into the suffix itself, and stops at the end of the tokens.
    assert lookup([4, 5, 6, 4, 5], n_max=2, n_min=1, k=10) == [6, 4, 5]


def test_no_match_gives_no_drafts():
    assert lookup([1, 2, 3, 4, 5], n_max=3, n_min=1, k=4) == []


def test_matches_shorter_than_n_min_are_ignored():
    tokens = [7, 3, 9, 5, 3]  # only the 1-gram [3] recurs
    assert lookup(tokens, n_max=3, n_min=2, k=2) == []
    assert lookup(tokens, n_max=3, n_min=1, k=2) == [9, 5]


def test_the_suffix_never_matches_itself():
    assert lookup([5], n_max=3, n_min=1, k=3) == []
    assert lookup([1, 2, 3], n_max=3, n_min=1, k=3) == []
    assert lookup([], n_max=3, n_min=1, k=3) == []


def test_overlapping_earlier_occurrence_counts():
    assert lookup([5, 5], n_max=3, n_min=1, k=3) == [5]
    # n = 3: [7, 7, 7] also starts at 0, overlapping the suffix; the token after it is the last one.
    assert lookup([7, 7, 7, 7], n_max=3, n_min=1, k=3) == [7]


def test_n_max_longer_than_the_tokens_still_finds_shorter_matches():
    assert lookup([3, 4, 3], n_max=10, n_min=1, k=2) == [4, 3]


def test_lookup_source_proposes_one_hot_tokens_within_each_request_budget():
    params = SamplingParams()
    a = Sequence("a", [1, 2, 3, 4, 1, 2], params)
    b = Sequence("b", [9, 8, 7], params)
    proposal = LookupSource(n_max=3, n_min=1).propose([DraftRequest(a, 2), DraftRequest(b, 4)])
    assert proposal.probs is None
    assert proposal.tokens == [[3, 4], []]


def test_the_incremental_index_answers_exactly_as_the_scan():
    """Random token lists over small vocabularies (many repeats), grown a few tokens at a time as a
    sequence grows, sometimes cut and given another last token: the index's answer is always the scan's."""
    rng = random.Random(0)
    for _ in range(400):
        vocab = rng.choice([2, 3, 5, 50])
        n_max, n_min = rng.choice([(4, 1), (3, 2), (1, 1), (5, 3)])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 8))]
        index = NgramIndex(n_max, n_min)
        for _ in range(25):
            k = rng.randint(1, 6)
            assert index.lookup(tokens, k) == lookup(tokens, n_max, n_min, k), (tokens, n_max, n_min, k)
            if rng.random() < 0.05:  # not an extension of what was indexed: rebuilt
                tokens = tokens[: rng.randrange(1, len(tokens) + 1)] + [rng.randrange(vocab)]
            else:
                tokens = tokens + [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]


def test_an_index_fed_whole_prompts_at_once_answers_exactly_as_the_scan():
    """A first ask over a whole prompt, and later jumps of many tokens (a probe after many plain steps), take
    the bulk path (more than ngram.BULK new tokens); a token at a time the loop: both answer as the scan."""
    rng = random.Random(1)
    for _ in range(200):
        vocab = rng.choice([2, 3, 5, 50])
        n_max, n_min = rng.choice([(4, 1), (3, 2), (1, 1), (5, 3)])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(BULK + 1, 6 * BULK))]
        index = NgramIndex(n_max, n_min)
        for _ in range(8):
            k = rng.randint(1, 6)
            assert index.lookup(tokens, k) == lookup(tokens, n_max, n_min, k), (tokens, n_max, n_min, k)
            grow = rng.choice([1, 2, BULK, BULK + 1, 3 * BULK])
            tokens = tokens + [rng.randrange(vocab) for _ in range(grow)]


def test_the_source_keeps_one_index_per_sequence_on_its_draft_state():
    seq = Sequence("a", [1, 2, 3, 1, 2], SamplingParams())
    source = LookupSource(n_max=2, n_min=1)
    assert source.propose([DraftRequest(seq, 2)]).tokens == [[3, 1]]
    index = seq.draft.ngram
    assert index is not None
    seq.token_ids.extend([3, 9, 1, 2, 3])
    assert source.propose([DraftRequest(seq, 2)]).tokens == [[9, 1]]
    assert seq.draft.ngram is index
