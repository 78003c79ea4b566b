"""The step-cost model the goodput controller prices its plans with, measured on this host: profiled at start-up
(engine.speculative.calibrate), then corrected online from every step's own timings, so it follows the forward
in use (eager first, compiled once the background compile lands) and the batch's real shapes."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class LinearCost:
    """Online fit of seconds = a + b * n, exponentially forgetting old observations."""

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self._w = self._n = self._t = self._nn = self._nt = 0.0

    def observe(self, n: float, seconds: float) -> None:
        d = self.decay
        self._w = d * self._w + 1.0
        self._n = d * self._n + n
        self._t = d * self._t + seconds
        self._nn = d * self._nn + n * n
        self._nt = d * self._nt + n * seconds

    @property
    def ready(self) -> bool:
        return self._w > 0

    def coefficients(self) -> tuple[float, float]:
        """(a, b), both clamped to >= 0. Without spread in n, b is 0 and a the mean."""
        if not self.ready:
            return 0.0, 0.0
        mean_n, mean_t = self._n / self._w, self._t / self._w
        var = self._nn / self._w - mean_n**2
        b = max(0.0, (self._nt / self._w - mean_n * mean_t) / var) if var > 1e-9 else 0.0
        return max(0.0, mean_t - b * mean_n), b

    def __call__(self, n: float) -> float:
        a, b = self.coefficients()
        return a + b * n


class TargetCost:
    """The target's forward plus verification, by tokens fed M and context:

        seconds(M, context) = scale * (r(M) * base(M) + w * context)

    ``base``: the start-up profile, one-sequence forwards of a few sizes, piecewise linear between them (and past
    the largest along the last segment): a forward's cost is far from linear in M at small sizes (on a CPU, 2 or 3
    tokens can cost more than 5: other matmul kernels), so no line through it prices a draft right. ``context``:
    the sum over the fed tokens of their sequence's length in thousands (each fed token attends to its whole
    context), w from the profile's two context lengths. Corrected online, from every step: ``scale``, one factor
    for the whole profile, follows the forward in use (eager, then compiled) wherever the steps fall, so sizes
    the batch has not fed lately move with it; r, one factor per profiled size (the observations nearest it),
    learns each size's own error."""

    def __init__(self, scale_rate: float = 0.05, size_rate: float = 0.2) -> None:
        self.scale_rate = scale_rate
        self.size_rate = size_rate
        self.sizes = np.array([1.0, 2.0])
        self.base = np.array([1e-3, 1e-3])
        self.fix = np.ones(2)  # r at each profiled size
        self.w = 0.0
        self.scale = 1.0

    def set_profile(self, points: Iterable[tuple[float, float, float]]) -> None:
        """(tokens, context, seconds) of profiled one-sequence forwards, each size at one or more contexts."""
        pts = sorted(points)
        pairs = [(s2 - s1, c2 - c1, s2, c2) for (n1, c1, s1), (n2, c2, s2) in zip(pts, pts[1:]) if n1 == n2 and c2 > c1]
        # At most half of the longer forward: on a small model the difference is mostly timing noise.
        self.w = float(np.mean([min(max(0.0, ds / dc), 0.5 * s / c) for ds, dc, s, c in pairs])) if pairs else 0.0
        sizes = sorted({n for n, _, _ in pts})
        self.sizes = np.array(sizes, dtype=float)
        self.base = np.array([np.mean([s - self.w * c for n, c, s in pts if n == m]) for m in sizes])
        self.base = np.maximum(self.base, 1e-6)
        self.fix, self.scale = np.ones(len(sizes)), 1.0

    def _interp(self, values: np.ndarray, tokens: float) -> float:
        x = self.sizes
        if len(x) == 1:
            return float(values[0])
        if tokens > x[-1]:  # past the profile: along its last segment
            slope = (values[-1] - values[-2]) / (x[-1] - x[-2])
            return float(values[-1] + max(0.0, slope) * (tokens - x[-1]))
        return float(np.interp(tokens, x, values))

    def __call__(self, tokens: float, context: float = 0.0) -> float:
        return self.scale * (self._interp(self.fix * self.base, tokens) + self.w * context)

    def observe(self, tokens: float, context: float, seconds: float) -> None:
        if seconds <= 0.0:
            return
        shape = self._interp(self.base, tokens) + self.w * context
        self.scale *= (seconds / (self.scale * shape)) ** self.scale_rate
        i = int(np.argmin(np.abs(np.log(self.sizes) - np.log(max(tokens, 1.0)))))  # the nearest profiled size
        predicted = self(tokens, context)
        self.fix[i] *= (seconds / predicted) ** self.size_rate

    def per_token(self, length: np.ndarray) -> np.ndarray:
        """What one more token's attention to a context of ``length`` tokens adds (the rest of a token's cost
        depends on the step's size: ``linearize``)."""
        return self.scale * self.w * length / 1000.0

    def linearize(self, tokens: float, context: float, more: float) -> tuple[float, float, float]:
        """The plain step of ``tokens`` tokens, and the secant of the profile through ``more`` // 2 and ``more``
        tokens more, as (plain seconds, jump, per token): feeding d more tokens costs about jump + d * per token,
        exactly so at those two (the profile has bumps: at small sizes on a CPU, 2 or 3 tokens can cost more than
        5, so no one line prices every d right; the caller re-prices its plan exactly, ``extra``)."""
        t0 = self(tokens, context)
        d1, d2 = max(1.0, more // 2), max(2.0, more)
        if d2 <= d1:
            d2 = d1 + 1
        c1, c2 = self(tokens + d1, context) - t0, self(tokens + d2, context) - t0
        per_token = max(0.0, (c2 - c1) / (d2 - d1))
        return t0, max(0.0, c1 - per_token * d1), per_token

    def extra(self, tokens: float, context: float, more: float) -> float:
        """What feeding ``more`` tokens more adds to the step, by the profile itself."""
        return self(tokens + more, context) - self(tokens, context) if more > 0 else 0.0

    def terms(self) -> dict[str, float]:
        out = {f"target_{int(n)}_tokens": self(n) for n in self.sizes}
        out["target_per_token_per_1k_context"] = self.scale * self.w
        return out


class StepCostModel:
    """What a step's parts cost: the target (forward and verification), one forward of each model drafter
    (a + b * tokens fed), asking the lookups (by sequences asked), and what else a speculative step spends on the
    host beyond a plain step's (proposing, bookkeeping, verifying and appending more tokens; by sequences that
    speculate)."""

    def __init__(self, drafters: Iterable[str]) -> None:
        self.target = TargetCost()
        self.drafters = {name: LinearCost() for name in drafters}
        self.lookup = LinearCost()
        self.host = LinearCost()
        self.host_plain = LinearCost()  # a plain step's host work by sequences: what ``host`` is measured above

    def parameters(self) -> dict[str, float]:
        """The model's current terms in seconds, by name (for /metrics)."""
        out = self.target.terms()
        for name, fit in self.drafters.items():
            a, b = fit.coefficients()
            out[f"{name}_per_forward"], out[f"{name}_per_token"] = a, b
        for name, fit in (("lookup", self.lookup), ("host", self.host)):
            a, b = fit.coefficients()
            out[f"{name}_per_step"], out[f"{name}_per_sequence"] = a, b
        return out
