"""The draft vocabulary of an EAGLE-3 head: the most frequent tokens, sized by how much of the target's
greedy output it covers. A smaller lm_head makes every drafting step cheaper; a token outside it can never be
drafted, so coverage caps the head's acceptance."""

from __future__ import annotations

import torch

COVERAGE_GOAL = 0.98  # the automatic choice: the smallest candidate covering this share of target argmaxes
CANDIDATES = (1024, 2048, 4096, 8192, 16384, 32768)


def frequency_ranking(stream: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] target ids, most frequent in the token stream first (ties by id, so the order is reproducible)."""
    counts = torch.bincount(stream, minlength=vocab_size)[:vocab_size]  # [V]
    # a stable sort on -count keeps ties in id order
    return torch.sort(-counts, stable=True).indices


def coverage(draft_ids: torch.Tensor, tokens: torch.Tensor, vocab_size: int) -> float:
    """Share of ``tokens`` (e.g. the target's held-out argmaxes) whose id is among ``draft_ids``."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[draft_ids] = True
    return float(inside[tokens.flatten()].float().mean())


def choose(ranking: torch.Tensor, argmax_tokens: torch.Tensor, size: int | None) -> tuple[int, dict[int, float]]:
    """(draft vocabulary size, coverage by candidate size). ``size`` None picks the smallest candidate below the
    full vocabulary covering COVERAGE_GOAL of ``argmax_tokens``, else the full vocabulary."""
    v = ranking.numel()
    sizes = sorted({c for c in CANDIDATES if c < v} | {v} | ({min(size, v)} if size else set()))
    table = {n: coverage(ranking[:n], argmax_tokens, v) for n in sizes}
    if size:
        return min(size, v), table
    return next((n for n in sizes if table[n] >= COVERAGE_GOAL), v), table
