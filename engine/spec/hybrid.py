"""Two drafters behind one interface: prompt lookup where the context repeats itself, the draft model
everywhere else. Which one a sequence uses, and with how many drafts, is decided per step by
engine.spec.planner (the source with the higher expected tokens per unit of step cost); this class
only carries it out and keeps the proposals verifiable together.

Mixing is exact: an n-gram proposal is one-hot, so in a batch that samples, its rows of q are one-hot
vectors beside the draft model's real distributions, and the verifier's min(1, p/q) test and
residual max(0, p - q) hold row by row.
"""

from __future__ import annotations

import torch

from engine.sequence import Sequence
from engine.spec.draft_model import DraftModelDrafter
from engine.spec.drafter import DraftRequest, Proposal
from engine.spec.ngram import lookup


class HybridDrafter:
    def __init__(self, model: DraftModelDrafter, n_max: int, n_min: int) -> None:
        self.model = model
        self.n_max = n_max
        self.n_min = n_min
        self.forward_times = model.forward_times  # the engine's cost model reads the draft model's forwards
        self._matches: dict[str, list[int]] = {}  # this step's lookups, by request id

    def match(self, seq: Sequence, k: int, n_min: int | None = None) -> list[int]:
        """Up to k tokens the context predicts for ``seq`` ([] when no suffix of at least ``n_min``
        tokens, default the drafter's, occurred before). Remembered for this step's ``propose``."""
        tokens = lookup(seq.token_ids, self.n_max, self.n_min if n_min is None else n_min, k)
        self._matches[seq.request_id] = tokens
        return tokens

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        n = len(requests)
        tokens: list[list[int]] = [[] for _ in range(n)]
        by_model = [i for i, r in enumerate(requests) if not r.lookup]
        for i, r in enumerate(requests):
            if r.lookup:
                tokens[i] = self._matches.get(r.seq.request_id, [])[: r.max_drafts]
        self._matches.clear()
        inner = self.model.propose([requests[i] for i in by_model]) if by_model else Proposal([], None)
        for j, i in enumerate(by_model):
            tokens[i] = inner.tokens[j]
        if inner.probs is None:
            # Nobody the model drafted for samples (greedy verification reads tokens only), or only
            # lookups proposed: every q is one-hot, which is what probs=None means to the verifier.
            return Proposal(tokens, None)
        K = max(len(t) for t in tokens)
        probs = inner.probs.new_zeros(n, K, inner.probs.shape[-1])  # [n, K, V]
        for j, i in enumerate(by_model):
            probs[i, : inner.probs.shape[1]] = inner.probs[j]
        for i, r in enumerate(requests):
            if r.lookup and tokens[i]:
                probs[i, torch.arange(len(tokens[i])), torch.tensor(tokens[i], device=probs.device)] = 1.0  # one-hot q
        return Proposal(tokens, probs)
