"""A smaller model of the same family proposes k tokens autoregressively from its own paged cache."""

from __future__ import annotations

import time

import torch

from engine.sample import rng
from engine.sample.sampling import probs_from_logits, process_logits, row_spec, sample_from
from engine.speculative.source import DraftRequest, Proposal
from engine.structured.grammar import apply_masks
from engine.types.sequence import Sequence
from engine.worker.forward_batch import ForwardBatch
from engine.worker.model_runner import ModelRunner


class DraftModelSource:
    """The draft cache uses the target's block tables (same block size and block count), so the
    scheduler's allocation covers both. ``seq.draft_num_computed`` says how much of it is valid;
    after verification it is lowered to the accepted length, which is the whole rollback. Tokens the
    draft has not seen (after a preemption or lookup steps) are its lag, caught up before drafting."""

    name = "draft_model"

    def __init__(self, runner: ModelRunner, target_vocab: int, eos_ids: tuple[int, ...]) -> None:
        self.runner = runner
        self.vocab = target_vocab
        self.eos_ids = eos_ids
        self._forward_times: list[tuple[int, float]] = []

    def lag(self, seq: Sequence) -> int:
        return seq.num_tokens - 1 - self._computed(seq)

    def _computed(self, seq: Sequence) -> int:
        """Tokens of ``seq`` whose K/V the drafting runner's cache holds."""
        return seq.draft_num_computed

    def _advance(self, seq: Sequence, num_computed: int) -> None:
        seq.draft_num_computed = num_computed

    def drain_costs(self) -> list[tuple[int, float]]:
        times, self._forward_times = self._forward_times, []
        return times

    def _logits(self, batch: ForwardBatch) -> torch.Tensor:
        t0 = time.perf_counter()
        logits = self.runner.forward(batch)  # [n, V_draft]
        V_d = logits.shape[-1]
        # Vocabularies that differ only by padding rows: cut or pad the draft's to the target's,
        # giving padding tokens zero draft probability.
        if V_d > self.vocab:
            logits = logits[:, : self.vocab]
        elif V_d < self.vocab:
            logits = torch.nn.functional.pad(logits, (0, self.vocab - V_d), value=float("-inf"))
        self.runner.synchronize()
        self._forward_times.append((sum(len(t) for t in batch.token_ids), time.perf_counter() - t0))
        return logits

    def _pick(
        self, logits: torch.Tensor, reqs: list[DraftRequest], drafted: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's next draft, and q where verification needs it. logits [a, V] -> (tokens [a], q [a, V] | None)."""
        specs = [row_spec(r.seq, d, self.eos_ids, logits.shape[-1], logits.device) for r, d in zip(reqs, drafted)]
        logits = process_logits(logits, specs)
        # The draft proposes from the masked q: the grammar's own choices cost it nothing to match.
        walks = [(r.seq.grammar, i, []) for i, r in enumerate(reqs) if r.seq.grammar is not None]
        if walks:
            index = torch.tensor([i for _, i, _ in walks])
            logits = apply_masks(logits, walks[0][0].backend.masks(len(reqs), walks)[index], index)
        picked = logits.argmax(-1)  # [a]
        if all(r.seq.params.greedy for r in reqs):
            return picked, None
        q = probs_from_logits(logits, [s.params for s in specs])  # [a, V]
        dev = q.device
        keys = torch.tensor([r.seq.key for r in reqs], device=dev)  # [a]
        positions = torch.tensor([r.seq.num_tokens + len(d) for r, d in zip(reqs, drafted)], device=dev)  # [a]
        purposes = torch.tensor([rng.draft_purpose(r.seq.params.seed is not None) for r in reqs], device=dev)
        noise = rng.exponentials(keys, positions, purposes, self.vocab)  # [a, V]
        greedy = torch.tensor([r.seq.params.greedy for r in reqs], device=dev)
        return torch.where(greedy, picked, sample_from(q, noise)), q

    @staticmethod
    def _record(requests: list[DraftRequest], drafting: list[int], j: int, picked: torch.Tensor,
                q: torch.Tensor | None, drafted: torch.Tensor, probs: torch.Tensor | None, walked: list[int],
                lengths: list[int]) -> None:
        """Position j's drafts of rows ``drafting`` (and their q where kept) into drafted [n, K] / probs
        [n, K, V]; each structured row's grammar walks over its draft, the row ending where it completes."""
        index = torch.tensor(drafting, device=drafted.device)
        drafted[index, j] = picked
        if probs is not None and q is not None:
            probs[index, j] = q
        structured = [i for i in drafting if requests[i].seq.grammar is not None]
        for i, token in zip(structured, drafted[structured, j].tolist() if structured else []):
            grammar = requests[i].seq.grammar
            assert grammar is not None
            grammar.push([token])
            walked[i] += 1
            if grammar.finished:
                lengths[i] = j + 1

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        n = len(requests)
        K = max(r.max_drafts for r in requests)
        dev = self.runner.device
        # The drafts stay on the device until the end: the next position's input is this one's output,
        # so the loop never waits for the host (one read-back, after the last position).
        drafted = torch.zeros(n, max(K, 1), dtype=torch.long, device=dev)  # [n, K]
        # Only an unseeded sampled row is verified against q (seeded and greedy ones by tokens alone).
        needs_q = [not r.seq.params.greedy and r.seq.params.seed is None for r in requests]
        probs = torch.zeros(n, K, self.vocab, device=dev) if any(needs_q) else None  # [n, K, V]
        # Penalties read the drafts so far as generated tokens: only they need them on the host.
        penalised = any(r.seq.params.uses_penalties for r in requests)
        active = list(range(n))
        # A structured row's grammar walks over its drafts as they are drawn (so position j is masked as
        # the grammar stands after drafts[:j]) and is rolled back at the end; a row stops drafting once
        # its grammar is complete. lengths[i]: the drafts row i really has.
        walked = [0] * n
        lengths = [r.max_drafts for r in requests]
        for j in range(max(K, 1)):  # K == 0: a catch-up alone
            seqs = [requests[i].seq for i in active]
            if j == 0:  # catch up on (part of) what the draft has not seen, then predict
                starts = [self._computed(s) for s in seqs]
                feeds = [s.token_ids[c : c + requests[i].catch_up + (1 if requests[i].max_drafts else 0)]
                         for i, s, c in zip(active, seqs, starts)]
                batch = ForwardBatch(feeds, starts, [s.block_table for s in seqs],
                                     [1 if requests[i].max_drafts else 0 for i in active])
            else:
                starts = [s.num_tokens + j - 1 for s in seqs]
                index = torch.tensor(active, device=dev)
                batch = ForwardBatch([[0]] * len(active), starts, [s.block_table for s in seqs], [1] * len(active),
                                     input_ids=drafted[index, j - 1])
            logits = self._logits(batch)
            for s, start, fed in zip(seqs, starts, batch.token_ids):
                self._advance(s, start + len(fed))
            drafting = [i for i in active if requests[i].max_drafts]
            if drafting:
                so_far = drafted[drafting, :j].tolist() if penalised else [[0] * j] * len(drafting)
                picked, q = self._pick(logits, [requests[i] for i in drafting], so_far)
                self._record(requests, drafting, j, picked, q, drafted, probs, walked, lengths)
            active = [i for i in drafting if lengths[i] > j + 1]
            if not active:
                break
        for r, w in zip(requests, walked):
            if r.seq.grammar is not None:
                r.seq.grammar.pop(w)
        rows = drafted.tolist()
        return Proposal(tokens=[rows[i][:length] for i, length in enumerate(lengths)], probs=probs)
