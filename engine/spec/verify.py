"""Lossless verification of drafts against the target. Pure tensor functions.

For sequence b with k_b drafts x_0..x_{k_b-1}, the target scored positions 0..k_b, giving
distributions p_0..p_{k_b}. The drafter sampled x_j from q_j (one-hot when it has no distribution).

Sampling (Leviathan et al. 2023; Chen et al. 2023): accept x_j with probability min(1, p_j(x_j)/q_j(x_j));
at the first rejection j, emit a token drawn from norm(max(0, p_j - q_j)); if all k_b are accepted,
emit a bonus token drawn from p_{k_b}. Every emitted token is then distributed exactly as the target's
own sample given the same prefix: P(emit y) = min(p(y), q(y)) + (1 - sum_z min(p(z), q(z))) *
max(0, p(y) - q(y)) / sum_z max(0, p(z) - q(z)) = p(y).

Greedy is the case where p is one-hot at the target's argmax: x_j is accepted iff it equals it, and
the emitted token is the argmax at the first mismatch (or after the last draft).
"""

from __future__ import annotations

import torch

from engine.sampling import sample_from


def verify(
    target_probs: torch.Tensor,  # [B, K+1, V] p_j per position (unused rows for greedy are ignored)
    target_argmax: torch.Tensor,  # [B, K+1] long: argmax of the processed target logits
    draft_tokens: torch.Tensor,  # [B, K] long, padded past num_drafts
    draft_probs: torch.Tensor | None,  # [B, K, V] q_j, or None: every draft is a one-hot proposal
    num_drafts: torch.Tensor,  # [B] long, k_b <= K
    greedy: torch.Tensor,  # [B] bool
    uniforms: torch.Tensor,  # [B, K] U(0,1) for the accept tests
    noise: torch.Tensor,  # [B, V] Exp(1) for the one recovered or bonus draw
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (num_accepted [B], tokens [B, K+1]); sequence b emits tokens[b, : num_accepted[b] + 1]."""
    B, K = draft_tokens.shape
    ar = torch.arange(B, device=draft_tokens.device)
    in_range = torch.arange(K, device=draft_tokens.device)[None, :] < num_drafts[:, None]  # [B, K]

    p_x = target_probs[:, :K].gather(-1, draft_tokens[..., None])[..., 0]  # [B, K] p_j(x_j)
    q_x = (
        draft_probs.gather(-1, draft_tokens[..., None])[..., 0]
        if draft_probs is not None
        else torch.ones_like(p_x)
    )  # [B, K] q_j(x_j); > 0 because x_j was drawn from q_j
    # u < p/q, written without the division (q_x > 0 wherever in_range).
    accept_sampled = uniforms * q_x < p_x
    accept_greedy = draft_tokens == target_argmax[:, :K]
    accept = torch.where(greedy[:, None], accept_greedy, accept_sampled) & in_range  # [B, K]
    num_accepted = accept.long().cumprod(dim=-1).sum(dim=-1)  # [B] length of the accepted prefix

    # The one extra token: from the residual at a rejection, from p itself after full acceptance.
    p_a = target_probs[ar, num_accepted]  # [B, V]
    rejected = num_accepted < num_drafts  # [B]
    if draft_probs is not None:
        q_a = draft_probs[ar, num_accepted.clamp(max=K - 1)] if K > 0 else torch.zeros_like(p_a)  # [B, V]
    else:
        q_a = torch.zeros_like(p_a)
        if K > 0:
            x_a = draft_tokens[ar, num_accepted.clamp(max=K - 1)]
            q_a[ar, x_a] = 1.0  # the one-hot proposal
    residual = (p_a - q_a).clamp(min=0.0)  # [B, V]
    # A rejection implies p(x) < q(x) so the residual has mass; the guard only catches rounding.
    usable = rejected & (residual.sum(-1) > 0)
    final_dist = torch.where(usable[:, None], residual, p_a)
    sampled = sample_from(final_dist, noise)  # [B]
    final = torch.where(greedy, target_argmax[ar, num_accepted], sampled)  # [B]

    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(B, 1)], dim=1)  # [B, K+1]
    tokens[ar, num_accepted] = final
    return num_accepted, tokens


def verify_greedy(
    target_argmax: torch.Tensor,  # [B, K+1] long
    draft_tokens: torch.Tensor,  # [B, K] long
    num_drafts: torch.Tensor,  # [B] long
) -> tuple[torch.Tensor, torch.Tensor]:
    """The all-greedy batch without any distribution: accept while the draft equals the argmax."""
    B, K = draft_tokens.shape
    in_range = torch.arange(K, device=draft_tokens.device)[None, :] < num_drafts[:, None]  # [B, K]
    accept = (draft_tokens == target_argmax[:, :K]) & in_range
    num_accepted = accept.long().cumprod(dim=-1).sum(dim=-1)  # [B]
    # Accepted drafts equal the argmax, so the argmax row is the emitted sequence.
    return num_accepted, target_argmax
