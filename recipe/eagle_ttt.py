"""EAGLE-3's training-time test (TTT): the head run for S chain steps over a whole window at once, as it drafts.

Notation: window tokens x_0..x_T; the target's hidden h_t (three aux layers concatenated) at each position t.
Step 0 at position t reads emb(x_{t+1}) and fc(h_t). Step s >= 1 at position t reads emb(x_{t+1}) (teacher
forcing on tokens) and o_{s-1, t-1}, step s-1's pre-norm output one position back, as the engine's chain does.
Every step at t predicts x_{t+2}; step s at t stands for a real chain position only where t >= s.

Attention of step s at t sees the step-0 keys at positions <= t - s (the context the target computed) and the
chain's own keys: step r at position t - s + r for r = 1..s. Rotary positions are t in every step. Each step's
keys and values are built once and concatenated across steps (the "diagonal" mask of EAGLE-3's TTT).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

from engine import Eagle3Head

STEP_DECAY = 0.8  # step s's loss is weighted 0.8**s, EAGLE-3's choice


def ttt_mask(seq_len: int, step: int, device: torch.device | None = None) -> torch.Tensor:
    """[T, (step + 1) * T] bool, True where step ``step``'s query at t may attend: keys of steps 0..step."""
    t = torch.arange(seq_len, device=device)[:, None]  # [T, 1] query positions
    j = torch.arange(seq_len, device=device)[None, :]  # [1, T] key positions within one step's block
    blocks = [j <= t - step]  # step-0 keys: the target-fed context up to the chain's anchor t - s
    # the chain's own step-r key at position t - s + r (r = step is the diagonal: the query's own key)
    blocks += [j == t - step + r for r in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


def _attend(attn: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """LlamaAttention's math with a mask of our own. x [B, T, 2H]; keys/values of earlier steps are extended
    in place with this step's [B, KV, T, D]. Returns [B, T, H]."""
    b, t, _ = x.shape
    shape = (b, t, -1, attn.head_dim)
    q = attn.q_proj(x).view(shape).transpose(1, 2)  # [B, NH, T, D]
    k = attn.k_proj(x).view(shape).transpose(1, 2)  # [B, KV, T, D]
    v = attn.v_proj(x).view(shape).transpose(1, 2)  # [B, KV, T, D]
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    keys.append(k)
    values.append(v)
    k_all = repeat_kv(torch.cat(keys, dim=2), attn.num_key_value_groups)  # [B, NH, (s+1)T, D]
    v_all = repeat_kv(torch.cat(values, dim=2), attn.num_key_value_groups)  # [B, NH, (s+1)T, D]
    out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=attn.scaling)  # [B, NH, T, D]
    return attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def ttt_forward(head: Eagle3Head, input_ids: torch.Tensor, fused: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """input_ids [B, T] (x_{t+1} at t), fused [B, T, H] (fc(h_t) at t) -> each step's pre-norm output [B, T, H].

    Eagle3Layer.forward's math (norms, residual, MLP) with the TTT attention above.
    """
    b, t, _ = fused.shape
    layer = head.midlayer
    positions = torch.arange(t, device=fused.device).expand(b, t)  # [B, T]: rotary at t in every step
    cos, sin = head.rotary_emb(fused, position_ids=positions)
    # The tokens are teacher-forced, so the embedding half of the input is the same at every step.
    embeds = layer.input_layernorm(head.embed(input_ids).to(fused.dtype))  # [B, T, H]
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    hidden = fused
    for s in range(steps):
        if s:
            # o_{s-1, t-1} at t; position 0 has no predecessor (zeros, and t < s is out of the loss anyway)
            hidden = F.pad(outs[-1][:, :-1], (0, 0, 1, 0))  # [B, T, H]
        normed = layer.hidden_norm(hidden)
        residual = normed if layer.norm_before_residual else hidden
        x = torch.cat([embeds, normed], dim=-1)  # [B, T, 2H]
        x = residual + _attend(layer.self_attn, x, cos, sin, keys, values, ttt_mask(t, s, fused.device))
        outs.append(x + layer.mlp(layer.post_attention_layernorm(x)))
    return outs


def draft_logits(head: Eagle3Head, prenorm: torch.Tensor) -> torch.Tensor:
    """[..., H] -> float32 logits over the draft vocabulary [..., V_draft] (sorted target ids, see d2t)."""
    return head.lm_head(head.norm(prenorm)).float()


def ttt_losses(head: Eagle3Head, outs: list[torch.Tensor], target_logits: torch.Tensor,
               draft_ids: torch.Tensor) -> list[torch.Tensor]:
    """Per step, the soft cross-entropy of the head against the target's next-token distribution.

    target_logits [B, T, V]: the target's logits at t + 1 (its distribution for x_{t+2}) placed at t.
    draft_ids [V_draft]: sorted target ids of the draft vocabulary. The target's distribution is restricted to
    them and renormalised (a softmax over the gathered logits). Step s counts positions t >= s only.
    """
    p = F.softmax(target_logits[..., draft_ids].float(), dim=-1)  # [B, T, V_draft]
    losses = []
    for s, o in enumerate(outs):
        log_q = F.log_softmax(draft_logits(head, o[:, s:]), dim=-1)  # [B, T - s, V_draft]
        losses.append(-(p[:, s:] * log_q).sum(-1).mean())  # H(p, q) = -sum p log q, mean over positions
    return losses


def weighted_loss(losses: list[torch.Tensor]) -> torch.Tensor:
    return sum(STEP_DECAY**s * loss for s, loss in enumerate(losses))


@torch.no_grad()
def ttt_agreement(head: Eagle3Head, outs: list[torch.Tensor], target_logits: torch.Tensor,
                  draft_ids: torch.Tensor) -> list[tuple[int, int]]:
    """Per step, (agreeing, counted): positions t >= s where the head's argmax is the target's argmax (over the
    full vocabulary: a target argmax outside the draft vocabulary is a miss). The greedy acceptance of that
    chain depth given the tokens before it, its top-1 proxy."""
    target_top = target_logits.argmax(-1)  # [B, T] target ids
    counts = []
    for s, o in enumerate(outs):
        top = draft_ids[draft_logits(head, o[:, s:]).argmax(-1)]  # [B, T - s] target ids
        counts.append((int((top == target_top[:, s:]).sum()), top.numel()))
    return counts
