"""The draft loop of the sources that run a forward per draft position (a draft model, the target's early
layers, an EAGLE head). Each source supplies only its forward; the loop picks every position's drafts on the
device and feeds them to the next position, so the host reads the drafts once, after the last position."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.sample import rng
from engine.sample.sampling import argmax_rows, probs_from_logits, process_logits, row_spec, sample_from
from engine.speculative.source import DraftRequest, Proposal
from engine.structured.grammar import apply_masks
from engine.types.sequence import Sequence
from engine.worker.forward_batch import ForwardBatch

# Position j's forward: (j, active, drafted [n, K]) -> logits [d, V] over the target's vocabulary, one row
# per row of ``active`` (indices into the requests) that drafts, in ``active``'s order. Position 0 feeds
# what the source has not seen yet (its catch-up, then the last token); position j > 0 feeds
# drafted[active, j - 1] (chain_batch).
PositionForward = Callable[[int, list[int], torch.Tensor], torch.Tensor]


def chain_batch(seqs: list[Sequence], starts: list[int], drafted: torch.Tensor, active: list[int],
                j: int) -> ForwardBatch:
    """Position j > 0: each active row feeds its previous draft at ``starts``, read on the device
    (drafted [n, K]), so the step does not wait for the host."""
    index = torch.tensor(active, device=drafted.device)  # [a]
    return ForwardBatch([[0]] * len(active), starts, [s.block_table for s in seqs], [1] * len(active),
                        input_ids=drafted[index, j - 1])


def draft_chain(requests: list[DraftRequest], forward: PositionForward, vocab: int, eos_ids: tuple[int, ...],
                device: torch.device, confidence: float = 0.0) -> Proposal:
    """Up to ``max_drafts`` tokens per request, one ``forward`` per position over the rows still drafting;
    with every ``max_drafts`` 0, the one forward of position 0 (a catch-up alone). A row whose draft had less
    than ``confidence`` of the drafter's probability keeps it and drafts no further: from a calibrated drafter the
    drafts after an unsure one are the likeliest to fail, and each costs a forward here and a row of the target's
    verify (on the embedded pair's host, about 1 ms and 0.45 ms against a 3.5 ms plain step; its 1.5M draft is
    under-confident, and the cut did not pay there: docs/performance.md). The rule reads the drafter alone, never
    the target, so verification stays exact and sampled outputs keep the target's distribution."""
    n = len(requests)
    K = max(r.max_drafts for r in requests)
    # The drafts stay on the device until the end: the next position's input is this one's output,
    # so the loop never waits for the host (one read-back, after the last position).
    drafted = torch.zeros(n, max(K, 1), dtype=torch.long, device=device)  # [n, K]
    # Only an unseeded sampled row is verified against q (seeded and greedy ones by tokens alone).
    needs_q = [not r.seq.params.greedy and r.seq.params.seed is None for r in requests]
    probs = torch.zeros(n, K, vocab, device=device) if any(needs_q) else None  # [n, K, V]
    # Penalties read the drafts so far as generated tokens: only they need them on the host.
    penalised = any(r.seq.params.uses_penalties for r in requests)
    active = list(range(n))
    # A structured row's grammar walks over its drafts as they are drawn (so position j is masked as
    # the grammar stands after drafts[:j]) and is rolled back at the end; a row stops drafting once
    # its grammar is complete. lengths[i]: the drafts row i really has.
    walked = [0] * n
    lengths = [r.max_drafts for r in requests]
    for j in range(max(K, 1)):  # K == 0: a catch-up alone
        logits = forward(j, active, drafted)  # [d, V]
        drafting = [i for i in active if requests[i].max_drafts]
        if drafting:
            so_far = drafted[drafting, :j].tolist() if penalised else [[0] * j] * len(drafting)
            picked, q = _pick(logits, [requests[i] for i in drafting], so_far, vocab, eos_ids)
            _record(requests, drafting, j, picked, q, drafted, probs, walked, lengths)
            if confidence > 0.0:
                _stop_unsure(logits, picked, drafting, j, confidence, lengths)
        active = [i for i in drafting if lengths[i] > j + 1]
        if not active:
            break
    for r, w in zip(requests, walked):
        if r.seq.grammar is not None:
            r.seq.grammar.pop(w)
    rows = drafted.tolist()
    return Proposal(tokens=[rows[i][:length] for i, length in enumerate(lengths)], probs=probs)


def _pick(logits: torch.Tensor, reqs: list[DraftRequest], drafted: list[list[int]], vocab: int,
          eos_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's next draft, and q where verification needs it. logits [a, V] -> (tokens [a], q [a, V] | None)."""
    specs = [row_spec(r.seq, d, eos_ids, logits.shape[-1], logits.device) for r, d in zip(reqs, drafted)]
    logits = process_logits(logits, specs)
    # The draft proposes from the masked q: the grammar's own choices cost it nothing to match.
    walks = [(r.seq.grammar, i, []) for i, r in enumerate(reqs) if r.seq.grammar is not None]
    if walks:
        index = torch.tensor([i for _, i, _ in walks])
        logits = apply_masks(logits, walks[0][0].backend.masks(len(reqs), walks)[index], index)
    picked = argmax_rows(logits)  # [a]
    if all(r.seq.params.greedy for r in reqs):
        return picked, None
    q = probs_from_logits(logits, [s.params for s in specs])  # [a, V]
    dev = q.device
    keys = torch.tensor([r.seq.key for r in reqs], device=dev)  # [a]
    positions = torch.tensor([r.seq.num_tokens + len(d) for r, d in zip(reqs, drafted)], device=dev)  # [a]
    purposes = torch.tensor([rng.draft_purpose(r.seq.params.seed is not None) for r in reqs], device=dev)
    noise = rng.exponentials(keys, positions, purposes, vocab)  # [a, V]
    greedy = torch.tensor([r.seq.params.greedy for r in reqs], device=dev)
    return torch.where(greedy, picked, sample_from(q, noise)), q


def _stop_unsure(logits: torch.Tensor, picked: torch.Tensor, drafting: list[int], j: int, confidence: float,
                 lengths: list[int]) -> None:
    """Rows whose position-j draft had under ``confidence`` of the drafter's (unprocessed) probability end at it.
    logits [a, V], picked [a]: rows of ``drafting``. One small read-back per position, the price of skipping the
    forwards after it."""
    sure = torch.softmax(logits.float(), dim=-1).gather(1, picked[:, None])[:, 0]  # [a]
    for i, p in zip(drafting, sure.tolist()):
        if p < confidence:
            lengths[i] = min(lengths[i], j + 1)


def _record(requests: list[DraftRequest], drafting: list[int], j: int, picked: torch.Tensor, q: torch.Tensor | None,
            drafted: torch.Tensor, probs: torch.Tensor | None, walked: list[int], lengths: list[int]) -> None:
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
