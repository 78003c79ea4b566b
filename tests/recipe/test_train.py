from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from recipe.data import eval_windows, random_windows
from recipe.objectives import next_token_loss
from recipe.train import TrainConfig, lr_at, train


def test_lr_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    cfg = TrainConfig(steps=110, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)
    assert lr_at(110, cfg) == pytest.approx(0.1)


def test_random_windows_are_reproducible_from_the_seed_and_eval_windows_cover_each_token_once():
    stream = torch.arange(1000)
    a, b = random_windows(stream, 4, 16, seed=3), random_windows(stream, 4, 16, seed=3)
    for _ in range(3):
        x = next(a)
        assert x.shape == (4, 17) and torch.equal(x, next(b))
        assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(4, 16, dtype=torch.long))
    w = eval_windows(stream, 10)
    predicted = w[:, 1:].flatten()
    assert torch.equal(predicted, torch.arange(1, 1 + predicted.numel()))
    with pytest.raises(ValueError, match="fewer than one window"):
        next(random_windows(torch.arange(5), 1, 16, seed=0))


def test_training_learns_a_repeating_sequence_and_logs_progress(caplog):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=20, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
    stream = torch.arange(2000) % 7 + 3
    before = next_token_loss(model, eval_windows(stream, 16, 4)).item()
    with caplog.at_level(logging.INFO, logger="recipe"):
        result = train(model, random_windows(stream, 8, 16, seed=0), next_token_loss,
                       TrainConfig(steps=60, lr=1e-2, warmup_steps=5, log_every=20))
    after = next_token_loss(model, eval_windows(stream, 16, 4)).item()
    assert after < 0.2 < before
    assert result.tokens == 60 * 8 * 16
    lines = [r.getMessage() for r in caplog.records if "step" in r.getMessage()]
    assert len(lines) == 3 and "tok/s" in lines[0] and "loss" in lines[0] and "eta" in lines[0]
