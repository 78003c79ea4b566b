"""One training loop for the target (cross-entropy) and for drafts (KL to a teacher): AdamW, warmup + cosine."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

logger = logging.getLogger("recipe")


@dataclass(frozen=True)
class TrainConfig:
    steps: int
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    log_every: int = 10
    eval_every: int = 200


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, object]]:
    # Norm gains and biases are not decayed: shrinking them only fights the normalisation.
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@dataclass
class TrainResult:
    steps: int
    tokens: int
    seconds: float
    final_loss: float
    evals: list[tuple[int, float]]


def train(
    model: torch.nn.Module,
    batches: Iterator[torch.Tensor],
    loss_fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    cfg: TrainConfig,
    evaluate: Callable[[], float] | None = None,
    what: str = "train",
) -> TrainResult:
    """Run cfg.steps optimizer steps, logging step, loss, lr, tokens/s and ETA every cfg.log_every steps.

    loss_fn(model, batch [B, T+1]) returns a scalar. evaluate() returns a held-out figure logged beside the loss.
    """
    opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, fused=False)
    model.train()
    start = time.perf_counter()
    window_start, window_tokens, window_loss, window_n = start, 0, 0.0, 0
    tokens = 0
    evals: list[tuple[int, float]] = []
    loss_value = float("nan")
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = next(batches)
        loss = loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"{what}: loss is {loss_value} at step {step}; lower --lr")
        n = batch.shape[0] * (batch.shape[1] - 1)
        tokens += n
        window_tokens += n
        window_loss += loss_value
        window_n += 1
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.steps:
            now = time.perf_counter()
            rate = window_tokens / (now - window_start)
            eta = (now - start) / done * (cfg.steps - done)
            logger.info(
                "%s step %d/%d  loss %.4f  lr %.2e  %.0f tok/s  elapsed %s  eta %s",
                what, done, cfg.steps, window_loss / window_n, lr_at(step, cfg), rate,
                _hms(now - start), _hms(eta),
            )
            window_start, window_tokens, window_loss, window_n = now, 0, 0.0, 0
        if evaluate is not None and (done % cfg.eval_every == 0 or done == cfg.steps):
            model.eval()
            value = evaluate()
            model.train()
            evals.append((done, value))
            logger.info("%s step %d  held-out %.4f", what, done, value)
            window_start = time.perf_counter()
    model.eval()
    return TrainResult(cfg.steps, tokens, time.perf_counter() - start, loss_value, evals)


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
