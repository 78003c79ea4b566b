"""Prompt lookup: propose the tokens that followed the last occurrence of the current suffix."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.speculative.source import DraftRequest, Proposal
from engine.types.sequence import Sequence

BULK = 16  # new tokens past which NgramIndex indexes them with zip rather than a loop


def lookup(tokens: list[int], n_max: int, n_min: int, k: int) -> list[int]:
    """Longest n in [n_min, n_max] whose last-n suffix occurred earlier; return up to k tokens that
    followed its most recent earlier occurrence. Pure function of the token list."""
    L = len(tokens)
    arr = np.asarray(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        windows = sliding_window_view(arr[: L - 1], n)  # [L-n, n]: every n-gram that has a successor
        hits = np.flatnonzero((windows == arr[L - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # first token after the most recent match
            return tokens[start : start + k]
    return []


class NgramIndex:
    """``lookup`` for one growing token list, kept up to date as tokens are appended: where each n-gram
    that has a successor last began, per n. A lookup is then n_max dictionary probes instead of a
    scan of the whole sequence (at 32 sequences of a few hundred tokens the scan cost more host time
    per step than a CUDA-graph forward). A list that shrank, or whose last indexed token changed, is indexed
    again from scratch; one changed further back is not noticed."""

    def __init__(self, n_max: int, n_min: int) -> None:
        self.n_max, self.n_min = n_max, n_min
        self.starts: list[dict[tuple[int, ...], int]] = [{} for _ in range(n_max + 1)]  # by n
        self.tokens: list[int] = []  # what is indexed: a copy (a list cut and regrown is noticed by it)

    def _extend(self, tokens: list[int]) -> None:
        L, n = len(tokens), len(self.tokens)
        # Not an extension: start over. A sequence's tokens only ever grow, so the length and the last token
        # indexed tell: comparing every indexed token took as long as the rest of a lookup (32 sequences of 1000
        # tokens, 3 new each: 0.5 ms a step, 0.28 ms without).
        if L < n or (n and tokens[n - 1] != self.tokens[n - 1]):
            self.__init__(self.n_max, self.n_min)  # type: ignore[misc]
        # An n-gram at i has a successor once the list holds i + n + 1 tokens: index every n-gram ending
        # before the last token (at end - 1, for end in [first, L)), in order, so the latest occurrence wins.
        first = max(len(self.tokens), 1)
        if L - first > BULK:
            # zip builds the tuples in C: a new sequence's ~400-token prompt is indexed in 0.13 ms instead of
            # 0.35, and a probe asks every fresh request of the batch at once. A step's token or two is
            # cheaper by the loop below.
            for n in range(1, self.n_max + 1):
                lo = max(first, n) - n  # the first new n-gram's start
                if lo < L - n:
                    grams = zip(*(tokens[lo + j : L - n + j] for j in range(n)))
                    self.starts[n].update(zip(grams, range(lo, L - n)))
        else:
            for end in range(first, L):  # n-grams ending at end - 1 (successor at end)
                for n in range(1, min(self.n_max, end) + 1):
                    self.starts[n][tuple(tokens[end - n : end])] = end - n
        self.tokens.extend(tokens[len(self.tokens) :])

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Exactly ``lookup(tokens, n_max, n_min, k)``."""
        self._extend(tokens)
        L = len(tokens)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            start = self.starts[n].get(tuple(tokens[L - n :]))
            if start is not None:
                return tokens[start + n : start + n + k]
        return []


class LookupSource:
    """No model, no cache and no distribution: proposals are one-hot, which the verifier handles
    exactly, and cost a Python lookup, so the planner may ask for them before deciding anything."""

    name = "ngram"

    def __init__(self, n_max: int, n_min: int) -> None:
        self.n_max = n_max
        self.n_min = n_min

    def lag(self, seq: Sequence) -> int:
        return 0

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        return Proposal(tokens=[self._index(r.seq).lookup(r.seq.token_ids, r.max_drafts) for r in requests],
                        probs=None)

    def index_new(self, seqs: list[Sequence]) -> None:
        """Indexes the tokens of each of ``seqs`` not indexed yet, as its first lookup would."""
        for seq in seqs:
            if seq.draft.ngram is None:
                self._index(seq)._extend(seq.token_ids)

    def _index(self, seq: Sequence) -> NgramIndex:
        d = seq.draft
        if d.ngram is None:
            d.ngram = NgramIndex(self.n_max, self.n_min)
        return d.ngram

    def drain_costs(self) -> list[tuple[int, float, bool]]:
        return []
