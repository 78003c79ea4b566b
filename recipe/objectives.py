"""Training objectives and the held-out measure, as pure functions of models and token windows."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def next_token_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of batch[:, 1:] given batch[:, :-1]. batch: [B, T+1]."""
    logits = model(input_ids=batch[:, :-1]).logits  # [B, T, V]
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def distill_loss(teacher: torch.nn.Module, student: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(p_teacher || q_student), the forward KL.

    Forward KL puts the student's mass where the teacher's is, which is what acceptance rewards: a greedy
    draft is accepted when its argmax is the teacher's, a sampled one with probability sum min(p, q).
    Vocabularies may differ in padding rows: both are cut to the shorter.
    """
    inputs = batch[:, :-1]
    with torch.no_grad():
        p_logits = teacher(input_ids=inputs).logits.float()  # [B, T, Vt]
    q_logits = student(input_ids=inputs).logits.float()  # [B, T, Vs]
    v = min(p_logits.shape[-1], q_logits.shape[-1])
    log_p = F.log_softmax(p_logits[..., :v], dim=-1)
    log_q = F.log_softmax(q_logits[..., :v], dim=-1)
    return F.kl_div(log_q.flatten(0, 1), log_p.flatten(0, 1), log_target=True, reduction="batchmean")


@torch.no_grad()
def bits_per_byte(
    model: torch.nn.Module, windows: torch.Tensor, byte_lengths: torch.Tensor, batch_size: int = 8
) -> float:
    """Total cross-entropy in bits over the bytes the predicted tokens spell. windows: [W, T+1].

    Per byte, not per token, so tokenizers of different granularity compare; special tokens spell no bytes
    but their loss still counts (the model has to predict where a file ends).
    """
    nats, nbytes = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        batch = windows[i : i + batch_size]
        logits = model(input_ids=batch[:, :-1]).logits.float()
        targets = batch[:, 1:]
        nats += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
        nbytes += int(byte_lengths[targets].sum())
    return nats / math.log(2) / max(1, nbytes)
