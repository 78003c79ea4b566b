"""A smaller model of the same family proposes k tokens autoregressively from its own paged cache."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import torch

from engine.layers.attention_metadata import SHORT_QUERY
from engine.speculative.chain import chain_batch, draft_chain
from engine.speculative.source import DraftRequest, Proposal
from engine.types.sequence import Sequence
from engine.worker.forward_batch import ForwardBatch
from engine.worker.model_runner import ModelRunner


class DraftModelSource:
    """The draft cache uses the target's block tables (same block size and block count), so the
    scheduler's allocation covers both. ``seq.draft_num_computed`` says how much of it is valid;
    after verification it is lowered to the accepted length, which is the whole rollback. Tokens the
    draft has not seen (after a preemption or lookup steps) are its lag, caught up before drafting."""

    name = "draft_model"

    def __init__(self, runner: ModelRunner, target_vocab: int, eos_ids: tuple[int, ...],
                 confidence: float = 0.0) -> None:
        self.runner = runner
        self.vocab = target_vocab
        self.eos_ids = eos_ids
        self.confidence = confidence  # engine.speculative.chain.draft_chain's: stop a row after an unsure draft
        self._forward_times: list[tuple[int, float, bool]] = []

    def lag(self, seq: Sequence) -> int:
        return seq.num_tokens - 1 - self._computed(seq)

    def _computed(self, seq: Sequence) -> int:
        """Tokens of ``seq`` whose K/V the drafting runner's cache holds."""
        return seq.draft_num_computed

    def _advance(self, seq: Sequence, num_computed: int) -> None:
        seq.draft_num_computed = num_computed

    def drain_costs(self) -> list[tuple[int, float, bool]]:
        times, self._forward_times = self._forward_times, []
        return times

    def _timed(self, batch: ForwardBatch, forward: Callable[[ForwardBatch], torch.Tensor]) -> torch.Tensor:
        """``forward(batch)``, waited for and timed: (fed tokens, seconds, whether a sequence fed a long query) joins
        the costs drain_costs returns."""
        t0 = time.perf_counter()
        logits = forward(batch)
        self.runner.synchronize()
        fed = [len(t) for t in batch.token_ids]
        self._forward_times.append((sum(fed), time.perf_counter() - t0, max(fed) > SHORT_QUERY))
        return logits

    def _logits(self, batch: ForwardBatch) -> torch.Tensor:
        logits = self.runner.forward(batch)  # [n, V_draft]
        V_d = logits.shape[-1]
        # Vocabularies that differ only by padding rows: cut or pad the draft's to the target's,
        # giving padding tokens zero draft probability.
        if V_d > self.vocab:
            return logits[:, : self.vocab]
        if V_d < self.vocab:
            return torch.nn.functional.pad(logits, (0, self.vocab - V_d), value=float("-inf"))
        return logits

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        return draft_chain(requests, partial(self._position, requests), self.vocab, self.eos_ids, self.runner.device,
                           self.confidence)

    def _position(self, requests: list[DraftRequest], j: int, active: list[int], drafted: torch.Tensor) -> torch.Tensor:
        """Draft position j's forward over rows ``active`` (a chain.PositionForward)."""
        seqs = [requests[i].seq for i in active]
        if j == 0:  # catch up on (part of) what the draft has not seen, then predict
            starts = [self._computed(s) for s in seqs]
            feeds = [s.token_ids[c : c + requests[i].catch_up + (1 if requests[i].max_drafts else 0)]
                     for i, s, c in zip(active, seqs, starts)]
            batch = ForwardBatch(feeds, starts, [s.block_table for s in seqs],
                                 [1 if requests[i].max_drafts else 0 for i in active])
        else:
            batch = chain_batch(seqs, [s.num_tokens + j - 1 for s in seqs], drafted, active, j)
        logits = self._timed(batch, self._logits)
        for s, start, fed in zip(seqs, batch.starts, batch.token_ids):
            self._advance(s, start + len(fed))
        return logits
