"""One step's verification: from the target's logits rows to each sampling sequence's Verdict.

Sets up the [B, K+1] index of (sequence, position) rows, applies the request transforms, draws each
row's keyed random numbers, maps the drafter's q rows, runs the pure rules of engine.sample.verify,
and reads the result back to the host once (logprobs in one more call, only when asked for)."""

from __future__ import annotations

import math

import torch

from engine.sample import rng
from engine.sample.sampling import (
    argmax_rows,
    keeps_logits,
    logprobs_of,
    probs_from_logits,
    process_logits,
    row_spec,
    sample_from,
)
from engine.sample.verify import accepted_prefix, emitted, final_distribution, greedy_accepted
from engine.structured.grammar import apply_masks
from engine.types.outputs import Verdict
from engine.types.sequence import Sequence, TokenLogprob


class Verifier:
    def __init__(self, eos_ids: tuple[int, ...]) -> None:
        self.eos_ids = eos_ids

    def __call__(
        self,
        seqs: list[Sequence],
        drafts: list[list[int]],
        draft_probs: torch.Tensor | None,  # [B, K_d, V] q rows aligned with seqs, or None (one-hot / not needed)
        logits: torch.Tensor,  # [R, V]: len(drafts[b]) + 1 rows per sequence, in order
    ) -> list[Verdict]:
        if all(s.params.greedy and s.params.logprobs is None and s.grammar is None and keeps_logits(s) for s in seqs):
            return self._greedy(drafts, logits)
        verdicts: list[Verdict | None] = [None] * len(seqs)
        # amax propagates NaN and +inf, and is -inf only for a row with nothing finite: one reduction, one sync.
        bad = ~torch.isfinite(logits.amax(dim=-1))  # [R]
        keep = list(range(len(seqs)))
        if bool(bad.any()):
            keep, rows, row, bad_rows = [], [], 0, bad.tolist()
            for b, d in enumerate(drafts):
                n = len(d) + 1
                if any(bad_rows[row : row + n]):
                    verdicts[b] = Verdict([], error="the target's logits are not finite (NaN or inf)")
                else:
                    keep.append(b)
                    rows.extend(range(row, row + n))
                row += n
            logits = logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
            if draft_probs is not None:
                draft_probs = draft_probs[torch.tensor(keep, dtype=torch.long, device=logits.device)]
        if keep:
            kept = self._verify([seqs[b] for b in keep], [drafts[b] for b in keep], draft_probs, logits)
            for b, v in zip(keep, kept):
                verdicts[b] = v
        return verdicts  # type: ignore[return-value]

    def _greedy(self, drafts: list[list[int]], logits: torch.Tensor) -> list[Verdict]:
        """A step where every row is the target's own greedy choice (the common decode): two reductions over the
        logits, read back once, and the acceptance on the host. Its per-step cost, a few dozen microseconds of
        Python, replaces some twenty small tensor ops; mixed steps keep the tensor path below."""
        # amax propagates NaN and +inf, and is -inf only for a row with nothing finite.
        top_l, choice_l = logits.amax(dim=-1).tolist(), argmax_rows(logits).tolist()  # [R], [R]
        verdicts, row = [], 0
        for d in drafts:
            n = len(d) + 1
            if not all(math.isfinite(x) for x in top_l[row : row + n]):
                verdicts.append(Verdict([], error="the target's logits are not finite (NaN or inf)"))
            else:
                a = greedy_accepted(d, choice_l[row : row + n])
                verdicts.append(Verdict(d[:a] + [choice_l[row + a]], len(d), a))
            row += n
        return verdicts

    def _verify(
        self, seqs: list[Sequence], drafts: list[list[int]], draft_probs: torch.Tensor | None, logits: torch.Tensor
    ) -> list[Verdict]:
        dev, V = logits.device, logits.shape[-1]
        ks = [len(d) for d in drafts]
        B, K = len(seqs), max(ks)
        specs = [row_spec(s, d[:j], self.eos_ids, V, dev) for s, d in zip(seqs, drafts) for j in range(len(d) + 1)]
        processed = constrain(process_logits(logits, specs), seqs, drafts)  # [R, V]
        # Row of (sequence b, position j) in the flat logits; padding positions repeat the last row.
        ks_t = torch.tensor(ks, device=dev)  # [B]
        offsets = (ks_t + 1).cumsum(0) - (ks_t + 1)  # [B] first row of each sequence
        index = offsets[:, None] + torch.minimum(torch.arange(K + 1, device=dev)[None, :], ks_t[:, None])  # [B, K+1]
        draft_t = torch.tensor([d + [0] * (K - len(d)) for d in drafts], dtype=torch.long, device=dev)  # [B, K]
        choice = argmax_rows(processed)[index]  # [B, K+1]: the greedy choice
        greedy = [s.params.greedy for s in seqs]
        seeded = [not g and s.params.seed is not None for s, g in zip(seqs, greedy)]
        probs = keys = first = None
        if not all(greedy):  # an all-greedy step (the common decode) needs no distributions and no draws
            probs = probs_from_logits(processed, [sp.params for sp in specs])[index]  # [B, K+1, V]
            keys = torch.tensor([s.key for s in seqs], dtype=torch.long, device=dev)  # [B]
            first = torch.tensor([s.num_tokens for s in seqs], dtype=torch.long, device=dev)  # [B] position of row 0
        if any(seeded):
            assert probs is not None and keys is not None and first is not None
            # A seeded row's choice at each position is its keyed exponential race (see verify.py).
            sb = torch.tensor([b for b in range(B) if seeded[b]], device=dev)  # [S]
            positions = first[sb, None] + torch.arange(K + 1, device=dev)  # [S, K+1]
            noise = rng.exponentials(keys[sb, None].expand_as(positions).reshape(-1), positions.reshape(-1),
                                     rng.Purpose.SAMPLE, V)  # [S*(K+1), V]
            choice[sb] = sample_from(probs[sb].reshape(-1, V), noise).view(len(sb), K + 1)
        deterministic = [g or s for g, s in zip(greedy, seeded)]
        if all(deterministic):
            # Accepted drafts equal the choice, so the choice row is the emitted sequence.
            num_acc = accepted_prefix(None, choice, draft_t, None, ks_t, choice.new_ones(B, dtype=torch.bool), None)
            tokens = choice
        else:
            assert probs is not None and keys is not None and first is not None
            det_t = torch.tensor(deterministic, device=dev)  # [B]
            q = draft_probs[:, :K] if draft_probs is not None else None  # [B, K, V]
            u = rng.uniforms(keys[:, None].expand(B, K).reshape(-1),
                             (first[:, None] + torch.arange(K, device=dev)).reshape(-1),
                             rng.Purpose.ACCEPT).view(B, K)  # [B, K]
            num_acc = accepted_prefix(probs, choice, draft_t, q, ks_t, det_t, u)
            # The extra token of a rejection-rule row is drawn at its own position, now known (no sync).
            rb = torch.tensor([b for b in range(B) if not deterministic[b]], device=dev)  # [Rr]
            dist = final_distribution(probs[rb], draft_t[rb], q[rb] if q is not None else None, num_acc[rb], ks_t[rb])
            noise = rng.exponentials(keys[rb], first[rb] + num_acc[rb], rng.Purpose.SAMPLE, V)  # [Rr, V]
            final = choice[torch.arange(B, device=dev), num_acc]  # [B]
            final[rb] = sample_from(dist, noise)
            tokens = emitted(draft_t, num_acc, final)
        num_acc_l, tokens_l = num_acc.tolist(), tokens.tolist()
        out = [tokens_l[b][: a + 1] for b, a in enumerate(num_acc_l)]
        logprobs = self._logprobs(seqs, out, offsets, logits)
        return [Verdict(out[b], ks[b], num_acc_l[b], logprobs[b]) for b in range(B)]

    def _logprobs(
        self, seqs: list[Sequence], tokens: list[list[int]], offsets_t: torch.Tensor, logits: torch.Tensor
    ) -> list[list[TokenLogprob]]:
        """The target's raw logprobs of every emitted token of the sequences that asked, in one call."""
        result: list[list[TokenLogprob]] = [[] for _ in seqs]
        asked = [b for b, s in enumerate(seqs) if s.params.logprobs is not None]
        if not asked:
            return result
        offsets = offsets_t.tolist()
        rows = [offsets[b] + j for b in asked for j in range(len(tokens[b]))]
        chosen_t = torch.tensor([t for b in asked for t in tokens[b]], device=logits.device)
        top_n = max(seqs[b].params.logprobs or 0 for b in asked)
        chosen, top_v, top_i = logprobs_of(logits[torch.tensor(rows, device=logits.device)], chosen_t, top_n)
        chosen_l, top_v_l, top_i_l = chosen.tolist(), top_v.tolist(), top_i.tolist()
        r = 0
        for b in asked:
            n = seqs[b].params.logprobs or 0
            for t in tokens[b]:
                result[b].append(TokenLogprob(t, chosen_l[r], tuple(zip(top_i_l[r][:n], top_v_l[r][:n]))))
                r += 1
        return result


def constrain(logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]) -> torch.Tensor:
    """The grammar masks of the structured sequences' rows: the distribution verified against is the
    masked target's. Row j of sequence b is masked as the grammar stands after its drafts[:j]. Past a
    draft the grammar forbids, rows stay unmasked: that draft has masked probability 0 (greedy: it is
    not the masked argmax), so it is rejected like any other and no later row is ever used.
    logits [R, V] -> [R, V]."""
    walks, rows, row = [], [], 0
    for seq, d in zip(seqs, drafts):
        if seq.grammar is not None:
            valid = d[: seq.grammar.valid_prefix(d)]
            walks.append((seq.grammar, row, valid))
            rows.extend(range(row, row + len(valid) + 1))
        row += len(d) + 1
    if not walks:
        return logits
    backend = walks[0][0].backend
    index = torch.tensor(rows)
    return apply_masks(logits, backend.masks(logits.shape[0], walks)[index], index)
