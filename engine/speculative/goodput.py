"""The goodput controller's solver: for every decoding sequence of a step, which source drafts for it and how
many drafts (k in 0..cap), so that the whole step emits the most expected tokens per second.

A plan emits E = N + sum_i G_i(k_i) tokens, where G_i(k) = g_i1 + ... + g_ik and g_ij is the probability that
sequence i's first j drafts are all accepted (draft j adds a token exactly then). It costs

    T = T0 + F [any k_i > 0] + sum_i [k_i > 0] (f_i + k_i c_i) + sum_d K_d a_d

T0: the plain step (no drafts); F: what a step pays once if it speculates at all; c_i: one more draft's marginal
cost (the target's per-token cost, plus a model drafter's per-token cost); f_i: what speculating at all costs
the sequence (a draft model's catch-up, host work); a_d: one forward of model drafter d, which runs K_d = max k
over its sequences forwards (one per draft position). The best ratio E / T comes from Dinkelbach's method: for
a rate lambda, maximise E - lambda T, which splits into one choice per sequence once the K_d are fixed, so the
K_d are enumerated (k_max + 1 values per model drafter, and there are at most two); lambda then becomes the
found plan's rate, and the loop stops when the rate no longer grows (a few rounds: Dinkelbach's lambdas grow
superlinearly). Speculating is never forced: k = 0 for everyone (the plain step, rate N / T0) is always a
candidate. Everything is arrays over (sequence, source, k): a step of 64 sequences plans in well under a
millisecond.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Block:
    """One source's options for the step's sequences (S of them, K = k_max)."""

    source: str
    gains: np.ndarray  # [S, K] g_j per sequence, non-increasing in j; ignored past the sequence's cap
    caps: np.ndarray  # [S] most drafts the source can give each sequence (0: not an option for it)
    per_draft: np.ndarray  # [S] c: seconds one more draft adds to the step
    fixed: np.ndarray  # [S] f: seconds speculating adds to the step, however many drafts
    drafter: int | None = None  # index into the drafters' per-forward costs; None: a lookup (no forward)
    chance: np.ndarray | float = 1.0  # [S] the chance a sequence drafts at all: its costs above are expectations


@dataclass(frozen=True)
class Plan:
    choices: tuple[tuple[str | None, int], ...]  # per sequence: (source, k), (None, 0) for no drafts
    tokens: float  # expected tokens the step emits
    seconds: float  # the step's modelled cost
    plain_seconds: float  # T0

    @property
    def speculates(self) -> bool:
        return any(k for _, k in self.choices)

    @property
    def speedup(self) -> float:
        """Expected tokens per second over the plain step's."""
        n = len(self.choices)
        return (self.tokens / self.seconds) / (n / self.plain_seconds) if n and self.seconds > 0 else 1.0


def plain(num_seqs: int, plain_seconds: float) -> Plan:
    return Plan(((None, 0),) * num_seqs, float(num_seqs), plain_seconds, plain_seconds)


def solve(num_seqs: int, plain_seconds: float, blocks: list[Block], drafter_costs: tuple[float, ...], k_max: int,
          margin: float = 0.0, step_fixed: float = 0.0, drafter_k_max: int | None = None) -> Plan:
    """The plan with the highest expected tokens per second, if it beats the plain step's rate by more than
    ``margin`` (a relative safety margin for the model's errors); the plain step otherwise. ``k_max``: the most
    drafts of any source; ``drafter_k_max``: of a model drafter (k_max if None), whose blocks' caps keep within it
    and whose gains may stop there."""
    base = plain(num_seqs, plain_seconds)
    if not blocks or num_seqs == 0 or k_max <= 0:
        return base
    S, M, K = num_seqs, len(blocks), k_max
    ks = np.arange(1, K + 1)
    gain = np.zeros((S, M, K + 1))  # [S, M, K+1]: G, cumulative expected extra tokens; -inf past the cap
    cost = np.zeros((S, M, K + 1))  # [S, M, K+1]: f + k c for k > 0
    for m, b in enumerate(blocks):
        g = np.cumsum(b.gains[:, :K], axis=1)
        g = np.pad(g, ((0, 0), (0, K - g.shape[1])), mode="edge")  # past a drafter's gains: past its cap too
        gain[:, m, 1:] = np.where(ks[None, :] <= b.caps[:, None], g, -np.inf)
        cost[:, m, 1:] = b.fixed[:, None] + b.per_draft[:, None] * ks[None, :]
    a = np.asarray(drafter_costs, dtype=float)
    D = len(a)
    KD = K if drafter_k_max is None else min(K, drafter_k_max)
    combos = list(itertools.product(range(KD + 1), repeat=D))  # K_d per model drafter, smallest first
    grid = np.array(combos, dtype=int).reshape(len(combos), D)  # [Gr, D]
    # The cap of each source under each grid point: K_d for a model drafter, k_max for a lookup.
    caps = np.array([grid[:, b.drafter] if b.drafter is not None else np.full(len(grid), K) for b in blocks])  # [M, Gr]
    fixed_grid = grid @ a + step_fixed  # [Gr]
    sources = np.arange(M)[:, None]  # [M, 1]: with caps, picks upto[:, m, caps[m, g]] for every (m, g)
    drafter_of = np.array([-1 if b.drafter is None else b.drafter for b in blocks])  # [M]

    # Each round only prices the best plan at the current rate; the plan itself (a tuple per sequence) is built
    # once, for the rate the loop ends at: a step of 64 sequences takes a few rounds, and the host pays for each.
    found, rate = None, num_seqs / plain_seconds
    for _ in range(32):
        value = gain - rate * cost  # [S, M, K+1]; -inf past the caps, 0 at k = 0
        upto = np.maximum.accumulate(value, axis=2)  # best over k <= cap
        per_seq = upto[:, sources, caps].max(axis=1)  # [S, Gr]
        total = num_seqs - rate * plain_seconds + per_seq.sum(axis=0) - rate * fixed_grid  # [Gr]: E - lambda T
        g = int(np.argmax(total))  # the first maximum: the smallest K_d among equals
        if total[g] <= 1e-12 * num_seqs:
            break  # no plan beats the rate already found
        m, k, tokens, seconds = _pick(value, caps[:, g], drafter_of, gain, cost, a, num_seqs, plain_seconds,
                                      step_fixed)
        if tokens / seconds <= rate * (1 + 1e-12):
            break
        found, rate = (m, k, tokens, seconds), tokens / seconds
    if found is None:
        return base
    m, k, tokens, seconds = found
    choices = tuple((blocks[mi].source, ki) if ki else (None, 0) for mi, ki in zip(m.tolist(), k.tolist()))
    best = Plan(choices, tokens, seconds, plain_seconds)
    return best if best.speedup > 1.0 + margin else base


def solve_one(plain_seconds: float, blocks: list[Block], drafter_costs: tuple[float, ...], k_max: int,
              extra: Callable[[np.ndarray], np.ndarray], margin: float = 0.0, step_fixed: float = 0.0) -> Plan:
    """``solve`` for a batch of one sequence, exactly: with no joint choice to split, every (source, k) is priced
    whole and the best rate kept. ``extra`` [n] -> [n]: what feeding that many more tokens adds to the target's
    step, by its own profile, where ``solve`` prices a line through it. A step of one small sequence is a few
    milliseconds, and the general solver's two linearised rounds cost a tenth of one on the host (enough to
    leave speculation off where a fixed k gained a third)."""
    base = plain(1, plain_seconds)
    best, rate = base, 1.0 / plain_seconds
    ks = np.arange(1, k_max + 1, dtype=float)
    for b in blocks:
        cap = min(int(b.caps[0]), k_max)
        if cap <= 0:
            continue
        k = ks[:cap]  # [cap]
        chance = float(np.broadcast_to(np.asarray(b.chance, dtype=float), (1,))[0])
        tokens = 1.0 + np.cumsum(b.gains[0, :cap])  # [cap]
        seconds = plain_seconds + step_fixed + float(b.fixed[0]) + float(b.per_draft[0]) * k + extra(chance * k)
        if b.drafter is not None:
            seconds = seconds + drafter_costs[b.drafter] * k  # one forward per draft position
        rates = tokens / seconds
        j = int(np.argmax(rates))
        if rates[j] > rate:
            rate = float(rates[j])
            best = Plan(((b.source, j + 1),), float(tokens[j]), float(seconds[j]), plain_seconds)
    return best if best.speedup > 1.0 + margin else base


def _pick(value: np.ndarray, caps: np.ndarray, drafter_of: np.ndarray, gain: np.ndarray, cost: np.ndarray,
          a: np.ndarray, num_seqs: int, plain_seconds: float, step_fixed: float,
          ) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Each sequence's best (source m, k <= its cap) [S] each, and the plan's tokens and seconds with the K_d it
    really uses."""
    S, M, K1 = value.shape
    allowed = np.arange(K1)[None, None, :] <= caps[None, :, None]  # [1, M, K+1]
    flat = np.where(allowed, value, -np.inf).reshape(S, M * K1)
    pick = flat.argmax(axis=1)  # the first maximum: k = 0 of the first source (no drafts) unless a draft gains
    rows = np.arange(S)
    m, k = pick // K1, pick % K1
    k = np.where(flat[rows, pick] > 1e-12, k, 0)
    drafting = k > 0
    tokens = num_seqs + float(gain[rows, m, k][drafting].sum())
    seconds = plain_seconds + float(cost[rows, m, k][drafting].sum())
    drafter = drafter_of[m]  # [S]
    for d in range(len(a)):
        ours = drafting & (drafter == d)
        seconds += a[d] * (int(k[ours].max()) if ours.any() else 0)
    if drafting.any():
        seconds += step_fixed
    return m, k, tokens, seconds
