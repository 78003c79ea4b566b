"""Prompt lookup: propose the tokens that followed the last occurrence of the current suffix."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.sequence import Sequence
from engine.speculative.source import DraftRequest, Proposal


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


class LookupSource:
    """No model, no cache and no distribution: proposals are one-hot, which the verifier handles
    exactly, and cost a Python lookup, so the planner may ask for them before deciding anything."""

    name = "lookup"

    def __init__(self, n_max: int, n_min: int) -> None:
        self.n_max = n_max
        self.n_min = n_min

    def lag(self, seq: Sequence) -> int:
        return 0

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        return Proposal(
            tokens=[lookup(r.seq.token_ids, self.n_max, self.n_min, r.max_drafts) for r in requests],
            probs=None,
        )

    def drain_costs(self) -> list[tuple[int, float]]:
        return []
