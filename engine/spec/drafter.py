"""The one interface every drafter implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.sequence import Sequence


@dataclass(frozen=True)
class DraftRequest:
    seq: Sequence
    max_drafts: int  # propose at most this many (>= 1)
    lookup: bool = False  # a hybrid drafter: propose the n-gram match, not the draft model's tokens


@dataclass(frozen=True)
class Proposal:
    """Per request, the proposed tokens (possibly fewer than asked, possibly none), and the
    drafter's distributions q they were drawn from: ``probs[i, j]`` is q for ``tokens[i][j]``.
    ``probs`` is None for drafters with no distribution (each token is a one-hot proposal)."""

    tokens: list[list[int]]
    probs: torch.Tensor | None  # [n, K, V], padded past each request's own length


class Drafter(Protocol):
    def propose(self, requests: list[DraftRequest]) -> Proposal: ...
