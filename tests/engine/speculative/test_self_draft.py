"""Self-speculation: the target's first layers draft over the target's own KV cache. (Its losslessness is in
the greedy and sampling matrices; its cache after mixed accepts and rejects in test_llm_engine.py.)"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from engine import LLM, EngineConfig, SamplingParams
from engine.models.early_exit import EarlyExitError, truncate
from tests.engine.core.test_llm_engine import _cache_matches_fresh_prefill
from tests.engine.lossless import alternate_drafters, prompts_for


def self_llm(ms, k=4, layers=1, **kw) -> LLM:  # noqa: ANN001
    return LLM(model=str(ms.target), speculative_method="self", draft_layers=layers, num_speculative_tokens=k,
               dtype="float32", device="cpu", **kw)


@torch.inference_mode()
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_early_exit_is_the_targets_first_layers_then_its_norm_and_head(arch, model_sets):
    model = AutoModelForCausalLM.from_pretrained(model_sets[arch].target, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 40, 41, 42, 9]])
    before = model(ids).logits
    short = truncate(model, 2, 1)
    hidden = model(ids, output_hidden_states=True).hidden_states[1]  # after the first layer
    norm = model.model.norm if arch == "llama" else model.transformer.ln_f
    torch.testing.assert_close(short(ids).logits, model.lm_head(norm(hidden)), atol=1e-5, rtol=1e-5)
    # Shares every weight, copies none, and leaves the target whole.
    assert {p.data_ptr() for p in short.parameters()} < {p.data_ptr() for p in model.parameters()}
    torch.testing.assert_close(model(ids).logits, before)


def test_a_draft_as_deep_as_the_target_is_refused_naming_draft_layers(model_sets):
    with pytest.raises(EarlyExitError, match=r"draft_layers must be in \[1, 1\]"):
        self_llm(model_sets["llama"], layers=2)


@pytest.mark.parametrize("kw,field", [
    (dict(speculative_method="ngram", draft_layers=1), "draft_layers is for"),
    (dict(speculative_method="self", draft_layers=0), "draft_layers must be >= 1"),
    (dict(speculative_method="hybrid"), "needs draft_model or draft_layers"),
])
def test_bad_self_speculation_settings_are_config_errors(kw, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="m", **kw)


def test_the_drafts_cache_is_the_targets_and_its_layers_a_prefix(model_sets):
    engine = self_llm(model_sets["llama"]).engine
    runner = engine.drafting.source("self").runner
    assert runner.cache is engine.target.cache
    assert runner.layer_shapes == engine.target.layer_shapes[:1]


def test_default_draft_layers_is_a_third_of_the_targets(tmp_path, tokenizer_dir):
    from tests.tiny_models import save_model

    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, eos_token_id=0)
    save_model(cfg, tmp_path / "six", seed=3, tokenizer_dir=tokenizer_dir)
    engine = LLM(model=str(tmp_path / "six"), speculative_method="self", dtype="float32", device="cpu").engine
    assert len(engine.drafting.source("self").runner.layer_shapes) == 2


def test_self_and_draft_model_in_one_step_keep_both_caches_exact(model_sets, tokenizer_dir):
    """The hybrid with both drafters: a sequence drafting from the early layers leaves the draft model
    behind (its catch-up later), and the shared cache stays the target's."""
    ms = model_sets["llama"]
    llm = LLM(model=str(ms.target), draft_model=str(ms.draft), draft_layers=1, speculative_method="hybrid",
              num_speculative_tokens=3, dtype="float32", device="cpu")
    mixes = alternate_drafters(llm)
    engine = llm.engine
    prompts = prompts_for(tokenizer_dir)
    for i, p in enumerate(prompts[:4]):
        engine.add_request(str(i), p, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    for _ in range(12):
        engine.step()
    assert frozenset({"draft_model", "self"}) in mixes
    running = engine.scheduler.running
    assert any(0 < seq.draft_num_computed < seq.num_computed for seq in running), "no draft model lagging behind"
    for seq in running:
        _cache_matches_fresh_prefill(engine.target, ms.target, seq, seq.num_computed)
        if seq.draft_num_computed:
            _cache_matches_fresh_prefill(engine.drafting.source("draft_model").runner, ms.draft, seq,
                                         seq.draft_num_computed)
