"""A tiny target with peaked next-token distributions and a corpus for the distillation recipes' tests."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tests.tiny_models import CORPUS, VOCAB

TARGET = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128, eos_token_id=0, bos_token_id=1,
                     pad_token_id=2, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory, tokenizer_dir):
    """A random target whose next-token distributions are peaked (a random one is near uniform: nothing to
    learn beyond its entropy)."""
    out = tmp_path_factory.mktemp("recipe-target")
    torch.manual_seed(7)
    model = LlamaForCausalLM(TARGET).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def corpus_dirs(tmp_path_factory):
    train, held = tmp_path_factory.mktemp("recipe-train"), tmp_path_factory.mktemp("recipe-held")
    for i, text in enumerate(CORPUS * 3):
        (train / f"f{i}.py").write_text(text * 4)
    (held / "h.py").write_text("".join(CORPUS) * 3)
    return train, held


def distill_on_one_thread(argv: list[str], caplog: pytest.LogCaptureFixture, what: str) -> list[str]:
    """Runs `specd distill ARGV --threads 1` (restoring torch's thread count after) and returns its progress
    lines for ``what`` (the lines with a tokens/s figure); asserts it exits 0."""
    from server.cli import main

    threads = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="recipe"):
            assert main([*argv, "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    return [r.getMessage() for r in caplog.records if f"{what} step" in r.getMessage() and "tok/s" in r.getMessage()]
