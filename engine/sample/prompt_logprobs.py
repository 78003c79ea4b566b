"""Prompt logprobs: how the target scores each prompt token given the tokens before it."""

from __future__ import annotations

import torch

from engine.types.sequence import TokenLogprob

# Rows normalised at once: a prompt chunk's rows times the vocabulary in float32 would otherwise be materialised
# whole (2,048 x 128k x 4 bytes = 1 GiB for a Llama-3 chunk), twice over for the softmax.
SLICE_ROWS = 256


@torch.inference_mode()
def score(logits: torch.Tensor, targets: list[int], top_n: int) -> list[TokenLogprob]:
    """``logits`` [R, V] of R positions, ``targets`` the R tokens that follow them: each token's logprob under the
    raw (untempered) distribution, its rank (1 = the argmax) and the top ``top_n`` alternatives."""
    out: list[TokenLogprob] = []
    for lo in range(0, len(targets), SLICE_ROWS):
        part = logits[lo : lo + SLICE_ROWS].float()  # [r, V]
        logp = torch.log_softmax(part, dim=-1)  # [r, V]
        want = torch.tensor(targets[lo : lo + SLICE_ROWS], device=logits.device)  # [r]
        chosen = logp.gather(1, want[:, None])  # [r, 1]
        # Ties with the chosen token rank it first among them, as vLLM counts.
        ranks = (logp > chosen).sum(dim=1) + 1  # [r]
        top = logp.topk(top_n, dim=-1) if top_n else None
        chosen_l, ranks_l = chosen[:, 0].tolist(), ranks.tolist()
        values = top.values.tolist() if top is not None else [[] for _ in chosen_l]
        indices = top.indices.tolist() if top is not None else [[] for _ in chosen_l]
        for tok, lp, rank, vs, ix in zip(want.tolist(), chosen_l, ranks_l, values, indices):
            out.append(TokenLogprob(tok, lp, tuple(zip(ix, vs)), rank))
    return out
