from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from recipe.objectives import bits_per_byte, distill_loss, next_token_loss


def _llama(seed: int, hidden: int = 32, vocab: int = 50) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def test_distill_loss_is_zero_against_itself_and_positive_against_another_model():
    teacher = _llama(0)
    batch = torch.randint(0, 50, (2, 9))
    assert distill_loss(teacher, copy.deepcopy(teacher), batch).item() == pytest.approx(0.0, abs=1e-6)
    assert distill_loss(teacher, _llama(1), batch).item() > 1e-3


def test_distill_loss_equals_the_forward_kl_computed_by_hand():
    teacher, student = _llama(0), _llama(1)
    batch = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        p = teacher(input_ids=batch[:, :-1]).logits.softmax(-1)
        q = student(input_ids=batch[:, :-1]).logits.softmax(-1)
    want = (p * (p.log() - q.log())).sum(-1).mean()
    assert distill_loss(teacher, student, batch).item() == pytest.approx(want.item(), rel=1e-4)


def test_bits_per_byte_of_a_uniform_model_is_log2_vocab_over_bytes_per_token():
    model = _llama(0)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0: uniform over 50 tokens
    windows = torch.randint(1, 50, (3, 11))
    lengths = torch.full((50,), 4)
    got = bits_per_byte(model, windows, lengths)
    assert got == pytest.approx(math.log2(50) / 4, rel=1e-5)
    assert next_token_loss(model, windows).item() == pytest.approx(math.log(50), rel=1e-5)
