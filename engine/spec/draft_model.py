"""A smaller model of the same family proposes k tokens autoregressively from its own paged cache."""

from __future__ import annotations

import time

import torch

from engine.model_runner import ForwardBatch, ModelRunner
from engine.rng import RequestRandom
from engine.sampling import probs_from_logits, process_logits, row_spec, sample_from
from engine.spec.drafter import DraftRequest, Proposal


class DraftModelDrafter:
    """The draft cache uses the target's block tables (same block size and block count), so the
    scheduler's allocation covers both. ``seq.draft_num_computed`` says how much of it is valid;
    after verification the engine lowers it to the accepted length, which is the whole rollback."""

    def __init__(self, runner: ModelRunner, target_vocab: int, eos_ids: tuple[int, ...], rng: RequestRandom) -> None:
        self.runner = runner
        self.vocab = target_vocab
        self.eos_ids = eos_ids
        self.rng = rng
        self.forward_times: list[tuple[int, float]] = []  # (tokens, seconds) since last drained

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
        self.forward_times.append((sum(len(t) for t in batch.token_ids), time.perf_counter() - t0))
        return logits

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        n = len(requests)
        K = max(r.max_drafts for r in requests)
        tokens: list[list[int]] = [[] for _ in range(n)]
        # Greedy verification needs only the tokens: skip distributions and noise when nobody samples.
        sampled = any(not r.seq.params.greedy for r in requests)
        probs = torch.zeros(n, K, self.vocab, device=self.runner.device) if sampled else None  # [n, K, V]
        active = list(range(n))
        for j in range(K):
            feeds, starts = [], []
            for i in active:
                seq = requests[i].seq
                if j == 0:  # catch up on everything the draft has not seen, then predict
                    feeds.append(seq.token_ids[seq.draft_num_computed :])
                    starts.append(seq.draft_num_computed)
                else:
                    feeds.append(tokens[i][-1:])
                    starts.append(seq.num_tokens + j - 1)
            batch = ForwardBatch(
                token_ids=feeds,
                starts=starts,
                block_tables=[requests[i].seq.block_table for i in active],
                logits_rows=[1] * len(active),
            )
            logits = self._logits(batch)  # [a, V]
            specs = [row_spec(requests[i].seq, tokens[i], self.eos_ids) for i in active]
            logits = process_logits(logits, specs)
            picked_t = logits.argmax(-1)  # [a]
            if probs is not None:
                q = probs_from_logits(logits, [s.params for s in specs])  # [a, V]
                noise = torch.ones_like(q)  # [a, V]; greedy rows draw nothing from their streams
                for row, spec in enumerate(specs):
                    if not spec.params.greedy:
                        noise[row] = self.rng.exponentials(requests[active[row]].seq.request_id, 1, self.vocab)[0]
                greedy = torch.tensor([s.params.greedy for s in specs], device=q.device)
                picked_t = torch.where(greedy, picked_t, sample_from(q, noise))
                probs[active, j] = q
            picked = picked_t.tolist()
            for row, i in enumerate(active):
                tokens[i].append(picked[row])
                requests[i].seq.draft_num_computed = starts[row] + len(feeds[row])
            active = [i for i in active if requests[i].max_drafts > j + 1]
        return Proposal(tokens=tokens, probs=probs)
