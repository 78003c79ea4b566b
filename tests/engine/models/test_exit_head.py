"""Trained exit heads for self-speculation: the layout, the early exit through one, and the engine's choice of
head. (Losslessness with one is in the greedy and sampling matrices, as "self+exit".)"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.models import exit_head
from engine.models.exit_head import OUTSIDE, ExitHead, ExitHeadError
from engine.worker.forward_batch import ForwardBatch
from tests.engine.lossless import prompts_for
from tests.tiny_models import VOCAB


def _head(draft: int = 40, layers: int = 1, hidden: int = 64) -> ExitHead:
    torch.manual_seed(0)
    head = ExitHead(hidden, VOCAB, draft, layers)
    head.set_draft_vocab(torch.randperm(VOCAB)[:draft])
    return head.eval()


def test_a_saved_head_loads_equal_and_writes_draft_logits_at_their_target_ids(tmp_path):
    head = _head()
    exit_head.save(head, tmp_path)
    loaded = exit_head.load(tmp_path, 64, VOCAB)
    assert loaded.exit_layers == 1 and loaded.draft_vocab_size == 40
    torch.testing.assert_close(loaded.lm_head.weight, head.lm_head.weight)
    ids = loaded.draft_ids()
    assert ids.tolist() == sorted(ids.tolist()) and ids.unique().numel() == 40
    hidden = torch.randn(2, 3, 64)
    logits = loaded(hidden)  # [2, 3, V]
    inside = torch.zeros(VOCAB, dtype=torch.bool)
    inside[ids] = True
    torch.testing.assert_close(logits[..., ids], loaded.lm_head(hidden))
    assert (logits[..., ~inside] == OUTSIDE).all()


@pytest.mark.parametrize("edit,field", [
    (lambda c, s: c.update(hidden_size=32), "hidden_size is 32"),
    (lambda c, s: c.update(vocab_size=VOCAB + 1), "vocab_size"),
    (lambda c, s: c.pop("exit_layers"), "missing exit_layers"),
    (lambda c, s: c.update(architectures=["LlamaForCausalLM"]), "architectures"),
    (lambda c, s: s.update(d2t=torch.zeros(40, dtype=torch.long) - 1), "d2t"),
    (lambda c, s: s.update({"lm_head.weight": torch.zeros(41, 64)}), "does not fit"),
])
def test_misfit_exit_heads_are_refused_naming_the_field(tmp_path, edit, field):
    from safetensors.torch import load_file, save_file

    exit_head.save(_head(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    state = load_file(str(tmp_path / "model.safetensors"))
    edit(config, state)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ExitHeadError, match=field):
        exit_head.load(tmp_path, 64, VOCAB)


@torch.inference_mode()
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_early_exit_drafts_through_the_head_and_the_target_keeps_its_own(arch, exit_targets, model_sets):
    """The engine's draft logits equal the head over the target's normed layer-1 hidden states, while the
    target's logits stay its own LM head's."""
    llm = LLM(model=str(exit_targets[arch]), speculative_method="self", num_speculative_tokens=2, dtype="float32",
              device="cpu")
    runner = llm.engine.drafting.source("self").runner
    head = exit_head.load(exit_targets[arch] / exit_head.DIR_NAME, 64, VOCAB)
    assert isinstance(runner.model.get_output_embeddings(), ExitHead)
    assert len(runner.layer_shapes) == 1  # the head's depth is the default

    model = AutoModelForCausalLM.from_pretrained(model_sets[arch].target, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 40, 41, 42, 9]])
    hidden = model(ids, output_hidden_states=True).hidden_states[1]
    norm = model.model.norm if arch == "llama" else model.transformer.ln_f
    want = head(norm(hidden))[0]  # [T, V]
    target_want = model(ids).logits[0]

    batch = ForwardBatch([ids[0].tolist()], [0], [[0]], [6])  # block 0 of an idle engine's cache
    torch.testing.assert_close(runner.forward(batch), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(llm.engine.target.forward(batch), target_want, atol=1e-4, rtol=1e-4)


def test_at_another_depth_the_early_exit_reads_through_the_targets_head(exit_targets, tmp_path, caplog,
                                                                        tokenizer_dir):
    from tests.tiny_models import save_model, save_with_exit_head, tiny_config

    deep = tmp_path / "deep"
    save_model(tiny_config("llama", seed_layers=3), deep, seed=9, tokenizer_dir=tokenizer_dir)
    save_with_exit_head(deep, tmp_path / "deep-exit", seed=1, layers=2)
    with caplog.at_level(logging.INFO, logger="engine.core.loader"):
        llm = LLM(model=str(tmp_path / "deep-exit"), speculative_method="self", draft_layers=1,
                  num_speculative_tokens=2, dtype="float32", device="cpu")
    runner = llm.engine.drafting.source("self").runner
    assert not isinstance(runner.model.get_output_embeddings(), ExitHead)
    assert any("is for draft_layers 2" in r.getMessage() for r in caplog.records)
    default = LLM(model=str(tmp_path / "deep-exit"), speculative_method="self", num_speculative_tokens=2,
                  dtype="float32", device="cpu")
    assert len(default.engine.drafting.source("self").runner.layer_shapes) == 2  # the head's depth, not a third


def test_greedy_through_the_head_equals_the_target_and_the_head_drafts_outside_nothing(exit_targets, model_sets,
                                                                                      tokenizer_dir):
    arch = "llama"
    prompts = prompts_for(tokenizer_dir)[:3]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = LLM(model=str(model_sets[arch].target), dtype="float32", device="cpu").generate(prompts, params)
    llm = LLM(model=str(exit_targets[arch]), speculative_method="self", num_speculative_tokens=3, dtype="float32",
              device="cpu")
    proposed: list[int] = []
    source = llm.engine.drafting.source("self")
    propose = source.propose

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = propose(*args, **kwargs)
        proposed.extend(t for toks in out.tokens for t in toks)
        return out

    source.propose = spy
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    head = exit_head.load(exit_targets[arch] / exit_head.DIR_NAME, 64, VOCAB)
    assert proposed and set(proposed) <= set(head.draft_ids().tolist())
    assert llm.stats().num_accepted_tokens > 0


def test_exit_head_false_drafts_through_the_targets_own_head(exit_targets):
    llm = LLM(model=str(exit_targets["llama"]), speculative_method="self", exit_head=False, num_speculative_tokens=2,
              dtype="float32", device="cpu")
    runner = llm.engine.drafting.source("self").runner
    assert runner.model.get_output_embeddings() is llm.engine.target.model.get_output_embeddings()
