"""Lossless verification of drafts against the target. Pure tensor functions.

For sequence b with k_b drafts x_0..x_{k_b-1}, the target scored positions 0..k_b, giving
distributions p_0..p_{k_b}. The drafter proposed x_j from q_j (one-hot when it has no distribution).

Rejection rule (Leviathan et al. 2023; Chen et al. 2023), for rows that sample without a seed:
accept x_j with probability min(1, p_j(x_j)/q_j(x_j)); at the first rejection j, emit a token drawn
from norm(max(0, p_j - q_j)); if all k_b are accepted, emit a bonus token drawn from p_{k_b}. Every
emitted token is then distributed exactly as the target's own sample given the same prefix:
P(emit y) = min(p(y), q(y)) + (1 - sum_z min(p(z), q(z))) * max(0, p(y) - q(y)) / sum_z max(0, p(z) - q(z)) = p(y).

Deterministic rows: each position has a ``choice``, the token the target alone emits there, and a
draft is accepted iff it equals the choice; the choice at the first mismatch (or after the last
draft) is emitted. Greedy rows choose the argmax. A seeded sampled row chooses
y_t = argmax_i p_t(i) / E_t(i) with Exp(1) noise E_t keyed by (seed, t): an exact draw from p_t (the
exponential race). Its drafter draws x_t = argmax_i q_t(i) / E_t(i) with the same E_t, so the two agree
often when q is close to p (a Gumbel coupling: P(x = y) >= (1 - TV) / (1 + TV)), and whatever is
accepted, the output is y, the target's own sample path: it does not depend on the drafts, on k, on
the batch or on preemption. The price is acceptance below the rejection rule's 1 - TV.
"""

from __future__ import annotations

import torch


def accepted_prefix(
    target_probs: torch.Tensor | None,  # [B, K+1, V] p_j per position; None when every row is deterministic
    choice: torch.Tensor,  # [B, K+1] long: a deterministic row's token at each position
    draft_tokens: torch.Tensor,  # [B, K] long, padded past num_drafts
    draft_probs: torch.Tensor | None,  # [B, K, V] q_j, or None: every draft is a one-hot proposal
    num_drafts: torch.Tensor,  # [B] long, k_b <= K
    deterministic: torch.Tensor,  # [B] bool
    uniforms: torch.Tensor | None,  # [B, K] U(0,1) for the accept tests of the other rows
) -> torch.Tensor:
    """The number of accepted drafts per row, [B] long."""
    K = draft_tokens.shape[1]
    in_range = torch.arange(K, device=draft_tokens.device)[None, :] < num_drafts[:, None]  # [B, K]
    accept = draft_tokens == choice[:, :K]  # [B, K]
    if target_probs is not None and uniforms is not None:
        p_x = target_probs[:, :K].gather(-1, draft_tokens[..., None])[..., 0]  # [B, K] p_j(x_j)
        q_x = (
            draft_probs.gather(-1, draft_tokens[..., None])[..., 0] if draft_probs is not None else torch.ones_like(p_x)
        )  # [B, K] q_j(x_j); > 0 because x_j was drawn from q_j
        # u < p/q, written without the division (q_x > 0 wherever in_range).
        accept = torch.where(deterministic[:, None], accept, uniforms * q_x < p_x)
    return (accept & in_range).long().cumprod(dim=-1).sum(dim=-1)  # [B] length of the accepted prefix


def final_distribution(
    target_probs: torch.Tensor,  # [B, K+1, V]
    draft_tokens: torch.Tensor,  # [B, K] long
    draft_probs: torch.Tensor | None,  # [B, K, V] or None (one-hot proposals)
    num_accepted: torch.Tensor,  # [B] long
    num_drafts: torch.Tensor,  # [B] long
) -> torch.Tensor:
    """What the one extra token is drawn from: the residual norm(max(0, p - q)) at a rejection, p itself
    after full acceptance (unnormalised, [B, V]: the exponential race needs no normalisation)."""
    B, K = draft_tokens.shape
    ar = torch.arange(B, device=draft_tokens.device)
    p_a = target_probs[ar, num_accepted]  # [B, V]
    if K == 0:
        return p_a
    at = num_accepted.clamp(max=K - 1)
    if draft_probs is not None:
        q_a = draft_probs[ar, at]  # [B, V]
    else:
        q_a = torch.zeros_like(p_a)
        q_a[ar, draft_tokens[ar, at]] = 1.0  # the one-hot proposal
    residual = (p_a - q_a).clamp(min=0.0)  # [B, V]
    # A rejection implies p(x) < q(x) so the residual has mass; the guard only catches rounding.
    usable = (num_accepted < num_drafts) & (residual.sum(-1) > 0)  # [B]
    return torch.where(usable[:, None], residual, p_a)


def emitted(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """[B, K+1]: row b emits tokens[b, : num_accepted[b] + 1], its accepted drafts then ``final[b]``."""
    B = draft_tokens.shape[0]
    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(B, 1)], dim=1)  # [B, K+1]
    tokens[torch.arange(B, device=tokens.device), num_accepted] = final
    return tokens


def greedy_accepted(drafts: list[int], choice: list[int]) -> int:
    """The deterministic rule on the host, for a step read back whole: the length of the prefix of ``drafts``
    (k tokens) equal to the target's ``choice`` at each position (k + 1 tokens, the last for after them)."""
    return next((j for j, (d, c) in enumerate(zip(drafts, choice)) if d != c), len(drafts))
