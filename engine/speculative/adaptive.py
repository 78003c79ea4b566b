"""What each draft source's drafts are worth: per sequence and per draft position, the probability that the
first j drafts all hold (the gains the goodput controller weighs against their cost).

With per-token acceptance alpha, k drafts yield E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens per step (the
accepted prefix plus the one recovered or bonus token). Acceptance is not flat along the drafts, though: a
lookup's long proposal holds at first and then drifts, a draft model loses confidence. So each source keeps,
besides every sequence's own alpha (its level), a conditional acceptance per position over all sequences
(its shape): draft j holds, given the ones before it did, with probability alpha_seq * rho_j, where rho_j is
the source's position-j rate over its overall rate.
"""

from __future__ import annotations

import numpy as np

from engine.types.draft_state import AcceptanceEstimate, SourceTrack


def expected_tokens(alpha: float, k: int) -> float:
    """E(k) = sum_{i=0..k} alpha^i: tokens emitted per step with k drafts."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class SourceAcceptance:
    """One source's acceptance: the global rate, the conditional rate at each draft position, and each
    sequence's own rate (on its ``SourceTrack``, so a finished request leaves nothing behind here)."""

    def __init__(self, k_max: int, decay: float = 0.98, explore: float = 0.0) -> None:
        self.k_max = k_max
        # Optimism while the source is little known: a drafter the plan never picks would never show what it is
        # worth (lookups need none: their proposals are scored for free whoever drafts).
        self.explore = explore
        self.global_alpha = AcceptanceEstimate(decay=decay)
        self.decay = decay
        self._hits = [0.0] * k_max  # by position: drafts that held, given all before them did
        self._trials = [0.0] * k_max  # by position: drafts that were reached (all before them held)

    def alpha(self, track: SourceTrack) -> float:
        prior = self.global_alpha.value(prior=0.5)
        return track.alpha.value(prior) if track.alpha is not None else prior

    def position_rates(self) -> list[float]:
        """rho_j: position j's conditional acceptance over the global rate (1.0 where nothing was seen)."""
        overall = self.global_alpha.value(prior=0.5)
        if overall <= 0.0:
            return [1.0] * self.k_max
        weight = 4.0  # a position seen rarely stays near the overall rate
        return [(h + overall * weight) / (t + weight) / overall for h, t in zip(self._hits, self._trials)]

    def levels(self, tracks: list[SourceTrack]) -> np.ndarray:
        """[S]: each sequence's alpha as planned with, its estimate plus the source's exploration bonus. What every
        track shares is computed once: this runs for each source every planned step."""
        prior = self.global_alpha.value(prior=0.5)
        bonus = self.explore / (1.0 + self.global_alpha.trials) ** 0.5
        return np.array([prior if t.alpha is None else t.alpha.value(prior) for t in tracks]) + bonus

    def gains(self, tracks: list[SourceTrack], scale: np.ndarray | float = 1.0) -> np.ndarray:
        """[S, k_max]: for each sequence, g_j = scale * prod_{p<=j} min(1, level * rho_p), the probability that
        its first j drafts all hold (``scale``: e.g. the chance a lookup proposes anything at all)."""
        level = self.levels(tracks)  # [S]
        rho = np.array(self.position_rates())  # [K]
        return np.cumprod(np.minimum(1.0, level[:, None] * rho[None, :]), axis=1) * np.reshape(scale, (-1, 1))

    def observe(self, track: SourceTrack, k: int, accepted: int) -> None:
        """``k`` drafts verified, their first ``accepted`` accepted."""
        if k <= 0:
            return
        if track.alpha is None:
            track.alpha = AcceptanceEstimate()
        track.alpha.observe(k, accepted)
        self.global_alpha.observe(k, accepted)
        for j in range(min(k, accepted + 1, self.k_max)):  # positions reached: every accepted one and the first miss
            self._trials[j] = self.decay * self._trials[j] + 1.0
            self._hits[j] = self.decay * self._hits[j] + (1.0 if j < accepted else 0.0)
