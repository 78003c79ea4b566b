"""Prompt logprobs out of a step's logits: the rows forward_batch.prompt_rows asked for, before the verifier's."""

from __future__ import annotations

import torch

from engine.sample.prompt_logprobs import score
from engine.types.schedule import ScheduledSeq
from engine.worker.forward_batch import logits_rows


def take_prompt_logprobs(scheduled: list[ScheduledSeq], drafts: list[list[int]], logits: torch.Tensor) -> torch.Tensor:
    """Records on each sequence the logprobs of the prompt tokens its rows score, and returns the rows left
    ([R', V]: the sampling sequences' rows, in order, as the verifier reads them)."""
    if all(s.seq.params.prompt_logprobs is None for s in scheduled):  # the decode loop's case: nothing to take
        return logits
    counts = [logits_rows(s, d) for s, d in zip(scheduled, drafts)]
    if not any(n for n, _, _ in counts):
        return logits
    keep: list[int] = []
    at = 0
    for s, (n, pad, sampling) in zip(scheduled, counts):
        seq = s.seq
        if n:
            # Position p scores prompt token p + 1 (entry p). A recompute after preemption meets the positions
            # already recorded again: they are skipped, not recorded twice.
            start = seq.num_computed
            skip = min(n, max(0, len(seq.prompt_logprobs) - start))
            if skip < n:
                targets = seq.token_ids[start + 1 + skip : start + 1 + n]
                seq.prompt_logprobs += score(logits[at + skip : at + n], targets, seq.params.prompt_logprobs or 0)
        keep.extend(range(at + n + pad, at + n + pad + sampling))
        at += n + pad + sampling
    return logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]
