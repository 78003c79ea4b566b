"""`specd distill --method self`: an exit head for the target's early layers, optionally tuning those layers."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from engine import LLM, SamplingParams
from engine.models import exit_head
from recipe.corpus import text_files
from recipe.frozen_target import TrainJob
from recipe.self_distill import SelfSetup, exit_loss, train_exit
from recipe.train import TrainConfig
from server.cli import main
from tests.recipe.conftest import TARGET, distill_on_one_thread
from tests.tiny_models import VOCAB


def test_exit_loss_is_least_at_the_targets_restricted_distribution():
    torch.manual_seed(0)
    p_logits = 3 * torch.randn(2, 5, VOCAB)
    ids = torch.randperm(VOCAB)[:50].sort().values
    best = exit_loss(p_logits[..., ids], p_logits, ids)
    p = F.softmax(p_logits[..., ids], dim=-1)
    entropy = -(p * p.log()).sum(-1).mean()
    torch.testing.assert_close(best, entropy)  # H(p, p) = H(p): the minimum over q
    assert exit_loss(p_logits[..., ids] + torch.randn(2, 5, 50), p_logits, ids) > best


def _train(target, corpus_dirs, out, steps=30, **setup):  # noqa: ANN001, ANN003, ANN202
    train_dir, held_dir = corpus_dirs
    cfg = TrainConfig(steps=steps, lr=3e-3, warmup_steps=3, log_every=10, eval_every=max(1, steps // 2))
    defaults = dict(exit_layers=1, draft_vocab=200, seq_len=32, batch_size=4, seed=3, eval_windows=4)
    train_exit(TrainJob(str(target), out, text_files([str(train_dir)]), cfg, "cpu",
                        held_out=text_files([str(held_dir)]), corpus_name="tiny"), SelfSetup(**{**defaults, **setup}))
    return json.loads((out / exit_head.DIR_NAME / "training.json").read_text())


def test_training_raises_agreement_and_writes_the_target_with_a_head_the_engine_drafts_through(
        tiny_target, corpus_dirs, tmp_path, tokenizer_dir):
    record = _train(tiny_target, corpus_dirs, tmp_path, steps=40)
    curve = [loss for _, loss in record["exit_loss_curve"]]
    assert curve[-1] < 0.9 * curve[0], curve  # soft cross-entropy: its floor is the target's entropy, not 0
    agreement = [e["agreement"] for e in record["agreement"]]
    assert [e["step"] for e in record["agreement"]] == [0, 20, 40]
    assert agreement[-1] > agreement[0], agreement
    assert record["exit_layers"] == 1 and record["draft_vocab_size"] == 200 and not record["tune_layers"]
    assert record["trained"] == ["exit_head.lm_head.weight"] and record["quality"] == {}
    # The target's own files are copied unchanged beside the head.
    assert load_file(str(tmp_path / "model.safetensors")).keys() == load_file(
        str(tiny_target / "model.safetensors")).keys()
    for name, tensor in load_file(str(tiny_target / "model.safetensors")).items():
        torch.testing.assert_close(load_file(str(tmp_path / "model.safetensors"))[name], tensor, atol=0, rtol=0)
    head = exit_head.load(tmp_path / exit_head.DIR_NAME, TARGET.hidden_size, VOCAB)
    assert head.exit_layers == 1 and head.draft_vocab_size == 200

    prompts = [[5, 17, 40, 41, 42, 9], [30, 31, 32]]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    want = LLM(model=str(tiny_target), dtype="float32", device="cpu").generate(prompts, params)
    llm = LLM(model=str(tmp_path), speculative_method="self", num_speculative_tokens=3, dtype="float32", device="cpu")
    assert isinstance(llm.engine.drafting.source("self").runner.model.get_output_embeddings(), exit_head.ExitHead)
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in want]
    assert llm.stats().num_accepted_tokens > 0


def test_tuning_layers_changes_only_the_first_layers_and_records_the_targets_quality(
        tiny_target, corpus_dirs, tmp_path):
    record = _train(tiny_target, corpus_dirs, tmp_path, steps=6, tune_layers=True, quality_weight=1.0)
    assert record["tune_layers"] and record["quality_weight"] == 1.0
    assert set(record["trained"]) >= {"exit_head.lm_head.weight", "model.layers.0.self_attn.q_proj.weight"}
    assert not any(n.startswith("model.layers.1") for n in record["trained"])
    assert set(record["quality"]) == {"bits_per_token_before", "bits_per_token_after"}  # no byte lengths given
    before, after = load_file(str(tiny_target / "model.safetensors")), load_file(str(tmp_path / "model.safetensors"))
    assert before.keys() == after.keys()
    changed = {n for n in before if not torch.equal(before[n].float(), after[n].float())}
    assert changed and all(n.startswith("model.layers.0.") for n in changed), changed


def test_distill_cli_method_self_runs_end_to_end_and_refuses_flags_of_other_methods(tiny_target, corpus_dirs,
                                                                                     tmp_path, caplog):
    argv = ["distill", "--method", "self", "--target", str(tiny_target), "--out", str(tmp_path), "--corpus",
            str(corpus_dirs[0]), "--steps", "4", "--seq-len", "24", "--batch-size", "2", "--log-every", "2",
            "--draft-layers", "2", "--device", "cpu"]
    assert len(distill_on_one_thread(argv, caplog, "self")) == 2
    record = json.loads((tmp_path / exit_head.DIR_NAME / "training.json").read_text())
    assert record["exit_layers"] == 2 and record["eval_split"] == "train"
    assert exit_head.load(tmp_path / exit_head.DIR_NAME, TARGET.hidden_size, VOCAB).exit_layers == 2
    assert main([*argv, "--hidden-size", "32"]) == 2  # draft-model shape flags do not apply
    eagle = [a if a != "self" else "eagle" for a in argv]
    assert main([*eagle[: eagle.index("--draft-layers")], "--tune-layers"]) == 2  # self's flags neither
