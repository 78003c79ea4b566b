"""The step-cost model the goodput controller prices its plans with, measured on this host: profiled at start-up
(engine.speculative.calibrate), then corrected online from every step's own timings, so it follows the forward
in use (eager first, compiled once the background compile lands) and the batch's real shapes."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping

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


class HostCost:
    """What speculating adds to a step's host work, by draft source: seconds = a + sum over sources of b_s * (its
    sequences speculating). Sources differ: a lookup's drafts are a slice of a list, a draft model's carry its
    cache and its probabilities through the verifier (the embedded pair, 2 cores, fitted per run: 0.025 ms a
    sequence with suffix drafts alone, 0.067 in the hybrid, whose steps were mostly the draft model's), and one b
    fitted over every source priced a suffix draft like a draft model's, which turned marginal plans plain. A
    forgetting least squares over steps that mix sources, each coefficient shrunk toward the pooled fit (one b
    over all speculating sequences) by ``shrink`` of a step's evidence: a source never seen is priced like the
    rest, not as free, and one seen, however seldom, by its own steps (a pull of whole steps biased a source 300x
    cheaper than its neighbour eightfold toward it)."""

    def __init__(self, decay: float = 0.98, shrink: float = 0.01) -> None:
        self.decay, self.shrink = decay, shrink
        self.pooled = LinearCost(decay)
        self.names: list[str] = []
        self._xx, self._xy, self._w = np.zeros((1, 1)), np.zeros(1), 0.0
        self._fit: tuple[float, dict[str, float]] | None = None

    def observe(self, counts: Mapping[str, int], seconds: float) -> None:
        """``counts``: the step's speculating sequences by the source that drafted for them."""
        self.pooled.observe(sum(counts.values()), seconds)
        for name in counts:
            if name not in self.names:
                self.names.append(name)
                self._xx = np.pad(self._xx, ((0, 1), (0, 1)))
                self._xy = np.pad(self._xy, (0, 1))
        x = np.array([1.0] + [float(counts.get(n, 0)) for n in self.names])  # [1 + sources]
        d = self.decay
        self._xx = d * self._xx + np.outer(x, x)
        self._xy = d * self._xy + x * seconds
        self._w = d * self._w + 1.0
        self._fit = None

    def coefficients(self) -> tuple[float, dict[str, float]]:
        """(a, b by source), clamped to >= 0."""
        if self._fit is None:
            a0, b0 = self.pooled.coefficients()
            prior = np.array([a0] + [b0] * len(self.names))
            # Each coefficient's pull is ``shrink`` observations of its own column's mean square: scale-free, and
            # exactly the prior where a column never moved (the sums of a source never seen are all 0).
            lam = self.shrink * np.maximum(np.diag(self._xx) / max(self._w, 1e-12), 1.0)
            beta = np.maximum(np.linalg.solve(self._xx + np.diag(lam), self._xy + lam * prior), 0.0)
            self._fit = float(beta[0]), dict(zip(self.names, beta[1:].tolist()))
        return self._fit

    def per_sequence(self, name: str) -> float:
        return self.coefficients()[1].get(name, self.pooled.coefficients()[1])


def context_slope(points: list[tuple[float, float, float]]) -> float:
    """Seconds per token-thousand of context, from the pair of forwards of one size that differ the most in
    context (the wider apart, the less a timing's noise weighs), at most half of the longer forward's time."""
    pts = sorted(points)
    pairs = [(s2 - s1, c2 - c1, s2, c2) for (n1, c1, s1), (n2, c2, s2) in zip(pts, pts[1:]) if n1 == n2 and c2 > c1]
    if not pairs:
        return 0.0
    ds, dc, s, c = max(pairs, key=lambda p: p[1])
    return min(max(0.0, ds / dc), 0.5 * s / c)


class _Curve:
    """One layout's profile: seconds by tokens fed M, piecewise linear between profiled sizes (and past the largest
    along the last segment), plus w per token-thousand of context; ``fix``: each profiled size's own correction."""

    def __init__(self, points: list[tuple[float, float, float]], w: float | None = None) -> None:
        pts = sorted(points)
        self.w = context_slope(pts) if w is None else w
        sizes = sorted({n for n, _, _ in pts})
        self.sizes = np.array(sizes, dtype=float)
        self._xs, self._logs = [float(x) for x in sizes], [math.log(x) for x in sizes]  # the scalar path's
        self.base = np.maximum([np.mean([s - self.w * c for n, c, s in pts if n == m]) for m in sizes], 1e-6)
        self.fix = np.ones(len(sizes))
        self.fixed = self.fix * self.base  # kept equal to fix * base, which every price reads

    def interp(self, values: np.ndarray, tokens: float) -> float:
        # In plain Python: the controller prices and corrects one size at a time every step, where numpy's call
        # overhead was most of a plain step's planning and bookkeeping.
        x = self._xs
        if len(x) == 1:
            return float(values[0])
        i = bisect.bisect_left(x, tokens)
        if i == 0:
            return float(values[0])
        if i == len(x):
            slope = float(values[-1] - values[-2]) / (x[-1] - x[-2])
            return float(values[-1]) + max(0.0, slope) * (tokens - x[-1])
        lo, hi = float(values[i - 1]), float(values[i])
        return lo + (hi - lo) * (tokens - x[i - 1]) / (x[i] - x[i - 1])

    def interp_many(self, values: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """``interp`` at each of ``tokens`` [n] at once."""
        x = self.sizes
        if len(x) == 1:
            return np.full(tokens.shape, float(values[0]))
        slope = max(0.0, float((values[-1] - values[-2]) / (x[-1] - x[-2])))
        return np.where(tokens > x[-1], values[-1] + slope * (tokens - x[-1]), np.interp(tokens, x, values))

    def nearest(self, tokens: float) -> int:
        t = math.log(max(tokens, 1.0))
        return min(range(len(self._logs)), key=lambda i: abs(self._logs[i] - t))


class TargetCost:
    """The target's forward plus verification, by tokens fed M, context and layout:

        seconds(M, context, layout) = scale * (r(M) * base(M) + w * context)

    with one curve per layout: the decode (every sequence fed one token: its own kernels, its own compiled graph
    or CUDA graph) and the general one a verify or a prompt chunk takes. A plain step is priced on the first; a
    speculative one on the second, and the gap between them is what leaving the decode layout costs. ``base``:
    the start-up profile of each, piecewise linear between profiled sizes: a forward's cost is far from linear
    in M at small sizes (on a CPU, 2 or 3 tokens can cost more than 5: other matmul kernels), so no line through
    it prices a draft right. ``context``: the sum over the fed tokens of their sequence's length in thousands
    (each fed token attends to its whole context). Corrected online, from every step: ``scale``, one factor for
    both curves, follows the forward in use (eager, then compiled) wherever the steps fall, so sizes and a layout
    the batch has not fed lately move with it; r, per profiled size of each curve, learns that size's own error
    from the steps of its layout."""

    def __init__(self, scale_rate: float = 0.05, size_rate: float = 0.2) -> None:
        self.scale_rate = scale_rate
        self.size_rate = size_rate
        self.curves = {False: _Curve([(1.0, 0.0, 1e-3), (2.0, 0.0, 1e-3)]),
                       True: _Curve([(1.0, 0.0, 1e-3), (2.0, 0.0, 1e-3)])}
        self.scale = 1.0

    def set_profile(self, points: Iterable[tuple[float, ...]]) -> None:
        """(tokens, context, seconds[, verify]) of profiled forwards, each size at one or more contexts; points
        without the layout flag profile both layouts."""
        pts = list(points)
        w = context_slope([p[:3] for p in pts])  # one attention cost per token of context, for both layouts
        for verify in (False, True):
            mine = [p[:3] for p in pts if len(p) < 4 or bool(p[3]) == verify]
            self.curves[verify] = _Curve(mine or [p[:3] for p in pts], w)
        self.scale = 1.0

    def __call__(self, tokens: float, context: float = 0.0, verify: bool = False) -> float:
        c = self.curves[verify]
        return self.scale * (c.interp(c.fixed, tokens) + c.w * context)

    def many(self, tokens: np.ndarray, context: float = 0.0, verify: bool = False) -> np.ndarray:
        """The cost at each of ``tokens`` [n] (one context), as ``__call__`` gives it one at a time."""
        c = self.curves[verify]
        return self.scale * (c.interp_many(c.fixed, tokens) + c.w * context)

    def observe(self, tokens: float, context: float, seconds: float, verify: bool = False) -> None:
        if seconds <= 0.0:
            return
        c = self.curves[verify]
        shape = c.interp(c.base, tokens) + c.w * context
        self.scale *= (seconds / (self.scale * shape)) ** self.scale_rate
        i = c.nearest(tokens)
        c.fix[i] *= (seconds / self(tokens, context, verify)) ** self.size_rate
        c.fixed[i] = c.fix[i] * c.base[i]

    def per_token(self, length: np.ndarray) -> np.ndarray:
        """What one more token's attention to a context of ``length`` tokens adds (the rest of a token's cost
        depends on the step's size: ``linearize``)."""
        return self.scale * self.curves[True].w * length / 1000.0

    def linearize(self, tokens: float, context: float, more: float) -> tuple[float, float, float]:
        """The plain step of ``tokens`` tokens, and the secant from it to the verify layout at ``more`` // 2 and
        ``more`` tokens more, as (plain seconds, jump, per token): feeding d more tokens costs about jump + d * per
        token, exactly so at those two (the caller re-prices its plan exactly, ``extra``)."""
        t0 = self(tokens, context)
        d1, d2 = max(1.0, more // 2), max(2.0, more)
        if d2 <= d1:
            d2 = d1 + 1
        c1, c2 = self(tokens + d1, context, True) - t0, self(tokens + d2, context, True) - t0
        per_token = max(0.0, (c2 - c1) / (d2 - d1))
        return t0, max(0.0, c1 - per_token * d1), per_token

    def extra(self, tokens: float, context: float, more: float) -> float:
        """What feeding ``more`` tokens more (the verify layout) adds to the plain step, by the profile itself."""
        return self(tokens + more, context, True) - self(tokens, context) if more > 0 else 0.0

    def terms(self) -> dict[str, float]:
        out = {}
        for verify, name in ((False, "decode"), (True, "verify")):
            out |= {f"target_{name}_{int(n)}_tokens": self(n, 0.0, verify) for n in self.curves[verify].sizes}
        out["target_per_token_per_1k_context"] = self.scale * self.curves[True].w
        return out


class StepCostModel:
    """What a step's parts cost: the target (forward and verification), one forward of each model drafter
    (a + b * tokens fed), asking the lookups (by sequences asked), and what else a speculative step spends on the
    host beyond a plain step's (proposing, bookkeeping, verifying and appending more tokens; by sequences that
    speculate). A drafter's forwards that feed a sequence more than a short query's tokens (a catch-up past the
    compiled layouts: the prompt, a long stretch sat out) are fitted apart, in ``catch_ups``: they run eagerly,
    at several times a compiled forward's cost a token, and one line through both regimes prices neither."""

    def __init__(self, drafters: Iterable[str]) -> None:
        self.target = TargetCost()
        self.drafters = {name: LinearCost() for name in drafters}
        self.catch_ups = {name: LinearCost() for name in self.drafters}
        self.lookup = LinearCost()
        self.host = HostCost()
        self.host_plain = LinearCost()  # a plain step's host work by sequences: what ``host`` is measured above

    def parameters(self) -> dict[str, float]:
        """The model's current terms in seconds, by name (for /metrics)."""
        out = self.target.terms()
        for name, fit in self.drafters.items():
            a, b = fit.coefficients()
            out[f"{name}_per_forward"], out[f"{name}_per_token"] = a, b
            a, b = self.catch_ups[name].coefficients()
            out[f"{name}_catch_up_per_forward"], out[f"{name}_catch_up_per_token"] = a, b
        a, b = self.lookup.coefficients()
        out["lookup_per_step"], out["lookup_per_sequence"] = a, b
        a, by_source = self.host.coefficients()
        # host_per_sequence: the pooled fit, what a source not yet seen is priced at
        out["host_per_step"], out["host_per_sequence"] = a, self.host.pooled.coefficients()[1]
        out |= {f"host_per_sequence_{name}": b for name, b in by_source.items()}
        return out
