from __future__ import annotations

import json

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from engine.models.eagle_head import Eagle3Head, load_head
from recipe import draft_vocab
from recipe.corpus import text_files
from recipe.data import token_stream
from recipe.eagle import EagleSetup, default_aux_layers, eagle_config, train_eagle
from recipe.eagle_ttt import ttt_forward, ttt_mask
from recipe.frozen_target import TrainJob
from recipe.train import TrainConfig
from server.cli import main
from tests.recipe.conftest import TARGET, distill_on_one_thread
from tests.tiny_models import VOCAB


def _head(seed: int = 0, draft: int = 40) -> tuple[Eagle3Head, LlamaForCausalLM]:
    torch.manual_seed(seed)
    target = LlamaForCausalLM(TARGET).eval()
    head = Eagle3Head(eagle_config(TARGET, draft, default_aux_layers(4)), TARGET.hidden_size)
    head.share_embeddings(target.get_input_embeddings())
    head.config._attn_implementation = "sdpa"  # head.forward with no mask: causal attention
    return head.eval(), target


def test_ttt_step_zero_is_the_heads_own_causal_forward():
    head, _ = _head()
    ids = torch.randint(0, VOCAB, (1, 12))
    fused = torch.randn(1, 12, 64)
    with torch.no_grad():
        ref = head(ids, fused, torch.arange(12)[None])  # [1, T, H]
        outs = ttt_forward(head, ids, fused, steps=3)
    assert len(outs) == 3 and outs[0].shape == ref.shape
    torch.testing.assert_close(outs[0], ref, rtol=1e-5, atol=1e-5)


def test_ttt_mask_lets_step_s_see_the_context_up_to_its_anchor_and_its_own_chain():
    T, S = 6, 4
    for s in range(S):
        mask = ttt_mask(T, s)
        assert mask.shape == (T, (s + 1) * T)
        for t in range(T):
            allowed = {(r, j) for r in range(s + 1) for j in range(T) if mask[t, r * T + j]}
            expected = {(0, j) for j in range(T) if j <= t - s} | {(r, t - s + r) for r in range(1, s + 1)
                                                                  if t - s + r >= 0}
            if s == 0:
                expected = {(0, j) for j in range(t + 1)}  # plain causal
            assert allowed == expected, (s, t)


def test_ttt_steps_equal_the_engines_chain_drafted_one_token_at_a_time():
    """Step s at t must be what the chain computes from anchor a = t - s: the target-fed positions 0..a, then
    s positions fed the head's previous output. Causally that is head.forward over one sequence."""
    head, _ = _head(seed=1)
    T, S = 10, 3
    ids = torch.randint(0, VOCAB, (1, T))  # x_{t+1} at t
    fused = torch.randn(1, T, 64)
    with torch.no_grad():
        outs = ttt_forward(head, ids, fused, steps=S)
        for a in range(T - S + 1):
            hidden = fused[:, : a + 1]
            for s in range(1, S):
                prev = head(ids[:, : a + s], hidden, torch.arange(a + s)[None])[:, -1:]  # o_{s-1} at a + s - 1
                hidden = torch.cat([hidden, prev], dim=1)
                chain = head(ids[:, : a + s + 1], hidden, torch.arange(a + s + 1)[None])[:, -1]  # o_s at a + s
                torch.testing.assert_close(outs[s][:, a + s], chain, rtol=1e-4, atol=1e-5)


def test_draft_vocab_is_the_most_frequent_tokens_sized_by_coverage():
    stream = torch.tensor([5] * 50 + [3] * 30 + [7] * 15 + [1] * 5)
    ranking = draft_vocab.frequency_ranking(stream, 10)
    assert ranking[:4].tolist() == [5, 3, 7, 1]
    assert draft_vocab.coverage(ranking[:2], torch.tensor([5, 3, 7, 9]), 10) == 0.5
    size, table = draft_vocab.choose(ranking, stream, None)
    assert size == 10 and table == {10: 1.0}  # below the smallest candidate: the full vocabulary
    assert draft_vocab.choose(ranking, stream, 4) == (4, {4: 1.0, 10: 1.0})


def test_default_aux_layers():
    assert default_aux_layers(32) == (2, 16, 29)
    assert default_aux_layers(6) == (1, 3, 5)
    assert default_aux_layers(4) == (1, 2, 3)
    assert default_aux_layers(2) == (1, 1, 1)


def test_training_lowers_the_loss_and_writes_a_head_load_head_reads(tiny_target, corpus_dirs, tmp_path):
    train_dir, held_dir = corpus_dirs
    cfg = TrainConfig(steps=40, lr=3e-3, warmup_steps=4, log_every=8, eval_every=20)
    setup = EagleSetup(ttt_steps=3, draft_vocab=64, seq_len=32, batch_size=4, seed=3, eval_windows=4)
    train_eagle(TrainJob(str(tiny_target), tmp_path, text_files([str(train_dir)]), cfg, "cpu",
                         held_out=text_files([str(held_dir)]), corpus_name="tiny"), setup)
    record = json.loads((tmp_path / "training.json").read_text())
    curve = [loss for _, loss in record["loss_curve"]]
    assert curve[-1] < 0.8 * curve[0], curve
    assert record["draft_vocab_size"] == 64 and record["aux_layers"] == [1, 2, 3]
    assert [e["step"] for e in record["agreement"]] == [20, 40]
    assert all(len(e["agreement"]) == 3 for e in record["agreement"])
    assert record["tokens"] == 40 * 4 * 31 and record["eval_split"] == "held_out"

    head = load_head(str(tmp_path), TARGET.hidden_size, VOCAB)
    assert head.draft_vocab_size == 64 and head.config.num_hidden_layers == 1 and head.embed_tokens is None
    ids = torch.arange(64) + head.d2t  # draft id i is target id i + d2t[i]
    tok = AutoTokenizer.from_pretrained(tiny_target)
    top = draft_vocab.frequency_ranking(token_stream(text_files([str(train_dir)]), tok), VOCAB)[:64]
    assert ids.tolist() == sorted(top.tolist())
    assert head.t2d.sum() == 64 and bool(head.t2d[ids].all())
    logits = head.logits(torch.randn(2, TARGET.hidden_size))
    assert torch.isinf(logits[:, ~head.t2d]).all() and torch.isfinite(logits[:, head.t2d]).all()


def test_distill_cli_method_eagle_runs_end_to_end(tiny_target, corpus_dirs, tmp_path, caplog):
    argv = ["distill", "--method", "eagle", "--target", str(tiny_target), "--out", str(tmp_path), "--corpus",
            str(corpus_dirs[0]), "--steps", "4", "--seq-len", "24", "--batch-size", "2", "--log-every", "2",
            "--ttt-steps", "2", "--device", "cpu"]
    assert len(distill_on_one_thread(argv, caplog, "eagle")) == 2
    record = json.loads((tmp_path / "training.json").read_text())
    assert record["ttt_steps"] == 2 and record["draft_vocab_size"] == VOCAB  # tiny vocabulary: all of it
    assert record["eval_split"] == "train"  # a user corpus has no held-out split
    head = load_head(str(tmp_path), TARGET.hidden_size, VOCAB)
    assert head.config.eagle_config == {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}
    assert main([*argv, "--hidden-size", "32"]) == 2  # draft-model shape flags do not apply
