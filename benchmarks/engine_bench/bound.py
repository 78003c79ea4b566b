"""The speculative-decoding speedup bound and its inputs (see bench_engine.py's docstring)."""

from __future__ import annotations

import statistics

from . import VERIFY_SIZES


def expected(alpha: float, k: float) -> float:
    """E(alpha, k) of engine.speculative.adaptive.expected_tokens, for a real-valued (mean) k."""
    return k + 1 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def alpha_geo(mean_len: float, k: float) -> float:
    """The per-token acceptance a with E(a, k) = mean_len, by bisection."""
    if k <= 0 or mean_len <= 1.0:
        return 0.0
    if mean_len >= k + 1 - 1e-9:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected(mid, k) < mean_len else (lo, mid)
    return (lo + hi) / 2


def bound(alpha: float, k: float, c: float) -> float:
    return expected(alpha, k) / (1.0 + k * c)


def verify_factor(ratios: list[list[float]], tokens: float) -> float:
    """T(target forward on ``tokens`` new tokens per sequence) / T(on 1), interpolated linearly
    between the measured sizes (median over repeats)."""
    xs = [1.0, *map(float, VERIFY_SIZES)]
    ys = [1.0, *(statistics.median(r[i] for r in ratios) for i in range(len(VERIFY_SIZES)))]
    tokens = min(max(tokens, xs[0]), xs[-1])
    for i in range(1, len(xs)):
        if tokens <= xs[i]:
            return ys[i - 1] + (ys[i] - ys[i - 1]) * (tokens - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[-1]


def paired_speedup(rates: list[float], base: list[float]) -> float:
    """Median over repeats of the per-repeat ratio: both were measured interleaved in the same repeat,
    so the ratio cancels the load the repeat ran under (medians of each alone need not pair up)."""
    return statistics.median(r / b for r, b in zip(rates, base, strict=True))
