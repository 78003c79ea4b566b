"""Choosing the draft length k per sequence per step: maximise expected tokens per second.

With per-token acceptance alpha, k drafts yield E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens per
step (the accepted prefix plus the one recovered or bonus token). If a step without drafts costs
the sequence s seconds (its share of the batch's forward) and each draft adds m seconds (its share
of a draft forward plus the target's marginal cost of one more token), the rate is
E(k) / (s + k m) = E(k) / (s (1 + k c)) with c = m / s, the bound the benchmarks quote. At batch 1,
s is the whole forward; in a large batch s shrinks toward the per-token cost, c grows past 1 and
the best k falls to 0: speculation stops where it does not pay.
"""

from __future__ import annotations

from engine.types.draft_state import AcceptanceEstimate, SourceTrack


def expected_tokens(alpha: float, k: int) -> float:
    """E(k) = sum_{i=0..k} alpha^i: tokens emitted per step with k drafts."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_k(alpha: float, c: float, k_max: int) -> int:
    """argmax_k E(k) / (1 + k c) over 0..k_max (ties go to the smaller k)."""
    best, best_rate = 0, 1.0
    for k in range(1, k_max + 1):
        rate = expected_tokens(alpha, k) / (1.0 + k * c)
        if rate > best_rate * (1.0 + 1e-9):
            best, best_rate = k, rate
    return best


class LinearCost:
    """Online fit of seconds = a + b * tokens, exponentially forgetting old observations."""

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self._w = self._n = self._t = self._nn = self._nt = 0.0
        self.version = 0  # observations so far: what a cached value derived from the fit is keyed on

    def observe(self, tokens: int, seconds: float) -> None:
        self.version += 1
        d = self.decay
        self._w = d * self._w + 1.0
        self._n = d * self._n + tokens
        self._t = d * self._t + seconds
        self._nn = d * self._nn + tokens * tokens
        self._nt = d * self._nt + tokens * seconds

    @property
    def ready(self) -> bool:
        return self._w > 0

    def coefficients(self) -> tuple[float, float]:
        """(a, b), both clamped to >= 0. Without spread in token counts, b is 0 and a the mean."""
        if not self.ready:
            return 0.0, 0.0
        mean_n, mean_t = self._n / self._w, self._t / self._w
        var = self._nn / self._w - mean_n**2
        b = max(0.0, (self._nt / self._w - mean_n * mean_t) / var) if var > 1e-9 else 0.0
        return max(0.0, mean_t - b * mean_n), b

    def __call__(self, tokens: float) -> float:
        a, b = self.coefficients()
        return a + b * tokens


class AdaptivePolicy:
    """Per-sequence k from that sequence's acceptance and the measured costs of this batch size.
    A sequence that stopped speculating probes with one draft every ``probe_interval`` steps, so a
    drafter that starts to agree (a repetitive stretch, a smaller batch) is noticed again. Each
    probe that accepts nothing doubles that sequence's interval (up to ``max_probe_interval``), so a
    drafter that is simply useless costs almost nothing; any accepted probe resets it.

    The policy holds what is shared (costs, the global acceptance); what belongs to one sequence is
    its ``SourceTrack``, passed in, so a finished request leaves nothing behind here."""

    def __init__(self, k_max: int, probe_interval: int = 16, max_probe_interval: int = 256) -> None:
        self.k_max = k_max
        self.probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self.target_cost = LinearCost()
        self.draft_cost = LinearCost()
        self.global_alpha = AcceptanceEstimate(decay=0.98)
        self._ratio: tuple[tuple[int, int, int], float] | None = None

    def cost_ratio(self, batch: int) -> float:
        """c = m / s for a batch of ``batch`` decoding sequences (see the module docstring). Asked once per
        sequence per step with the same answer: kept until the batch size or a cost fit changes."""
        key = (batch, self.target_cost.version, self.draft_cost.version)
        if self._ratio is None or self._ratio[0] != key:
            self._ratio = key, self._cost_ratio(batch)
        return self._ratio[1]

    def _cost_ratio(self, batch: int) -> float:
        s = self.target_cost(batch) / batch
        a_t, b_t = self.target_cost.coefficients()
        m = b_t + self.draft_cost(batch) / batch
        return m / s if s > 0 else float("inf")

    def alpha(self, track: SourceTrack) -> float:
        prior = self.global_alpha.value(prior=0.5)
        return track.alpha.value(prior) if track.alpha is not None else prior

    def _cap(self, k_max: int | None) -> int:
        return self.k_max if k_max is None else min(k_max, self.k_max)

    def rate(self, track: SourceTrack, batch: int, k_max: int | None = None) -> float:
        """Expected tokens per step-cost at the best k, relative to not drafting (1.0); no side effects.
        Lets a caller with two sources pick the one that promises more."""
        alpha, c = self.alpha(track), self.cost_ratio(batch)
        k = best_k(alpha, c, self._cap(k_max))
        return expected_tokens(alpha, k) / (1.0 + k * c)

    def choose(self, track: SourceTrack, batch: int, k_max: int | None = None) -> int:
        k = best_k(self.alpha(track), self.cost_ratio(batch), self._cap(k_max))
        if k > 0:
            track.idle_steps = 0
            return k
        track.idle_steps += 1
        if track.idle_steps >= (track.probe_interval or self.probe_interval):
            track.idle_steps = 0
            track.probing = True
            return 1
        return 0

    def observe(self, track: SourceTrack, k: int, accepted: int) -> None:
        if k <= 0:
            return
        if track.alpha is None:
            track.alpha = AcceptanceEstimate()
        track.alpha.observe(k, accepted)
        self.global_alpha.observe(k, accepted)
        probed, track.probing = track.probing, False
        if accepted:
            track.probe_interval = None
        elif probed:
            track.probe_interval = min(2 * (track.probe_interval or self.probe_interval), self.max_probe_interval)
