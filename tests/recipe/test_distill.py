from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from engine import LLM, SamplingParams
from recipe.corpus import text_files
from recipe.data import eval_windows, token_stream
from recipe.distill import DraftShape, draft_config
from recipe.objectives import distill_loss
from server.cli import main
from tests.engine.lossless import Reference, assert_same_as_target, prompts_for
from tests.tiny_models import CORPUS


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    for i, text in enumerate(CORPUS * 3):
        (d / f"f{i}.py").write_text(text * 4)
    return d


@pytest.fixture(scope="module")
def distilled(tmp_path_factory, model_sets, corpus_dir):
    out = tmp_path_factory.mktemp("distilled")
    argv = ["distill", "--target", str(model_sets["llama"].target), "--out", str(out), "--corpus", str(corpus_dir),
            "--steps", "60", "--lr", "1e-2", "--hidden-size", "32", "--num-layers", "1", "--seq-len", "32",
            "--batch-size", "4", "--log-every", "20", "--device", "cpu", "--seed", "5"]
    assert main(argv) == 0
    return out


def test_distill_cli_writes_a_loadable_draft_with_the_targets_vocab_and_tokenizer(distilled, model_sets):
    target = AutoModelForCausalLM.from_pretrained(model_sets["llama"].target)
    draft = AutoModelForCausalLM.from_pretrained(distilled)
    assert draft.config.vocab_size == target.config.vocab_size
    assert draft.config.hidden_size == 32 and draft.config.num_hidden_layers == 1
    assert draft.dtype == torch.bfloat16
    assert (distilled / "tokenizer.json").read_text() == (model_sets["llama"].target / "tokenizer.json").read_text()
    record = json.loads((distilled / "training.json").read_text())
    assert record["tokens"] == 60 * 4 * 32 and record["device"] == "cpu"


def test_distillation_lowers_the_kl_to_the_target(distilled, model_sets, corpus_dir):
    target = AutoModelForCausalLM.from_pretrained(model_sets["llama"].target, dtype=torch.float32).eval()
    trained = AutoModelForCausalLM.from_pretrained(distilled, dtype=torch.float32).eval()
    torch.manual_seed(5)  # the draft's initial weights, as distill drew them
    untrained = LlamaForCausalLM(draft_config(target.config, DraftShape(32, 1, 1, 96), 32)).eval()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_sets["llama"].target)
    windows = eval_windows(token_stream(text_files([str(corpus_dir)]), tok), 32, max_windows=8)
    with torch.no_grad():
        before = distill_loss(target, untrained, windows).item()
        after = distill_loss(target, trained, windows).item()
    assert after < 0.5 * before, (before, after)


def test_a_distilled_draft_drives_lossless_speculation_in_the_engine(distilled, model_sets, tokenizer_dir):
    target = model_sets["llama"].target
    llm = LLM(str(target), draft_model=str(distilled), speculative_method="draft_model", num_speculative_tokens=4,
              dtype="float32", device="cpu")
    ref = Reference(target)
    prompts = prompts_for(tokenizer_dir)[:4]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))
    for p, out in zip(prompts, outs):
        assert_same_as_target(ref, p, list(out.token_ids), "distilled draft")
    assert llm.stats().num_draft_tokens > 0


def test_distill_logs_step_loss_and_throughput(model_sets, corpus_dir, tmp_path, caplog):
    argv = ["distill", "--target", str(model_sets["llama"].target), "--out", str(tmp_path), "--corpus",
            str(corpus_dir), "--steps", "4", "--hidden-size", "32", "--num-layers", "1", "--seq-len", "16",
            "--batch-size", "2", "--log-every", "2"]
    with caplog.at_level(logging.INFO, logger="recipe"):
        assert main(argv) == 0
    steps = [r.getMessage() for r in caplog.records if "distill step" in r.getMessage()]
    assert len(steps) == 2 and all("loss" in s and "tok/s" in s for s in steps)


def test_default_draft_shape_scales_with_the_target():
    big = LlamaConfig(hidden_size=4096, num_hidden_layers=32)
    assert DraftShape.for_target(big) == DraftShape(1024, 4, 32, 3072)
    tiny = LlamaConfig(hidden_size=64, num_hidden_layers=2)
    assert DraftShape.for_target(tiny) == DraftShape(64, 1, 2, 192)
