"""The one interface every draft source implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.types.sequence import Sequence


@dataclass(frozen=True)
class DraftRequest:
    seq: Sequence
    max_drafts: int  # propose at most this many (0: only catch up)
    catch_up: int = 0  # of the source's lag (``DraftSource.lag``), how many tokens it may process this step


@dataclass(frozen=True)
class Proposal:
    """Per request, the proposed tokens (possibly fewer than asked, possibly none), and the
    distributions q they were drawn from where verification needs them: ``probs[i, j]`` is q for
    ``tokens[i][j]`` in rows of requests that sample without a seed (the others are verified by
    their tokens alone). ``probs`` is None when no row needs one or every token is a one-hot proposal."""

    tokens: list[list[int]]
    probs: torch.Tensor | None  # [n, K, V], padded past each request's own length


class DraftSource(Protocol):
    """One way of guessing the target's next tokens: a draft model, prompt lookup, and later the
    target's own early layers or draft heads. ``name`` labels its metrics and its adaptive policy."""

    name: str

    def lag(self, seq: Sequence) -> int:
        """Tokens of ``seq`` the source must process before it can draft (0 for a stateless source).
        The scheduler counts them against the step's token budget."""
        ...

    def propose(self, requests: list[DraftRequest]) -> Proposal: ...

    def drain_costs(self) -> list[tuple[int, float, bool]]:
        """(tokens, seconds, long) of each forward the source ran since the last call; long: some sequence fed more
        than a short query's tokens (engine.layers.attention_metadata.SHORT_QUERY), which runs eagerly."""
        ...
