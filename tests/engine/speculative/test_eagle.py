"""EAGLE-3 heads: the published checkpoint layout, the paged forward against plain attention, the target's
captured hidden states, and the head's cache after mixed accepts and rejects."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.models.eagle_head import Eagle3Head, EagleHeadError, aux_layer_ids, load_head
from engine.speculative.eagle import EagleRunner
from engine.worker.forward_batch import ForwardBatch
from engine.worker.model_runner import ModelRunner
from tests.engine.lossless import prompts_for
from tests.tiny_models import VOCAB, eagle_head_config, save_eagle_head

PUBLISHED = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    *(f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")),
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
}


def test_a_saved_head_has_the_published_layout(tmp_path):
    save_eagle_head(tmp_path, seed=0, draft_vocab=100)
    state = load_file(str(tmp_path / "model.safetensors"))
    assert set(state) == PUBLISHED
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 100 and config["num_hidden_layers"] == 1
    assert state["fc.weight"].shape == (64, 3 * 64)
    assert state["midlayer.self_attn.q_proj.weight"].shape == (64, 2 * 64)  # reads [embedding ; hidden]
    assert state["lm_head.weight"].shape == (100, 64)
    assert state["d2t"].dtype == torch.long and state["t2d"].dtype == torch.bool and int(state["t2d"].sum()) == 100


def test_a_checkpoint_in_the_published_form_loads_as_the_head_its_config_describes(tmp_path):
    """Written as published heads ship: pytorch_model.bin, a plain Llama config.json with draft_vocab_size and
    the aux layer ids under eagle_config, d2t as offsets, no embedding (the target's is used)."""
    torch.manual_seed(3)
    built = Eagle3Head(eagle_head_config(64, 40), 64)
    ids = torch.randperm(VOCAB)[:40]
    built.set_draft_vocab(ids)
    for p in built.parameters():
        torch.nn.init.normal_(p, std=0.1)
    torch.save({k: v for k, v in built.state_dict().items()}, tmp_path / "pytorch_model.bin")
    config = eagle_head_config(64, 40).to_dict()
    config.update(architectures=["LlamaForCausalLMEagle3"],
                  eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 1]})
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_head(str(tmp_path), 64, VOCAB)
    assert loaded.embed_tokens is None
    for (name, a), b in zip(built.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    assert aux_layer_ids(loaded.config, 2) == (0, 1, 1)
    x = torch.randn(3, 64)
    logits = loaded.logits(x)  # [3, VOCAB]
    want = built.lm_head(built.norm(x))  # [3, 40]
    sorted_ids = ids.sort().values
    torch.testing.assert_close(logits[:, sorted_ids], want)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(logits[:, outside]).all()


def test_a_head_that_does_not_fit_the_target_is_refused(tmp_path):
    save_eagle_head(tmp_path, seed=0)
    with pytest.raises(EagleHeadError, match="vocabulary"):
        load_head(str(tmp_path), 64, VOCAB + 1)
    with pytest.raises(EagleHeadError, match="fc.weight"):
        load_head(str(tmp_path), 32, VOCAB)
    with pytest.raises(EagleHeadError, match="eagle_aux_hidden_state_layer_ids"):
        aux_layer_ids(eagle_head_config().__class__(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 5]}), 2)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("head")
    save_eagle_head(out, seed=7, draft_vocab=200)
    return out


def _reference_prenorm(head: Eagle3Head, tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """The head over one sequence from position 0 with plain causal attention: [T, H]."""
    ref = copy.deepcopy(head)
    ref.config._attn_implementation = "sdpa"  # no mask given: causal
    pos = torch.arange(len(tokens))[None]
    return ref(torch.tensor([tokens]), hidden[None], pos)[0]


def test_the_paged_forward_equals_plain_attention_over_each_sequence(model_sets, head_dir):
    target = ModelRunner.load(str(model_sets["llama"].target), "float32", "cpu")
    target.allocate_cache(16, 4)
    runner = EagleRunner.load(str(head_dir), target)
    runner.allocate_cache(16, 4)
    torch.manual_seed(0)
    a, b = [5, 9, 11, 40, 3, 7, 8], [100, 101, 102, 7, 7]
    ha, hb = torch.randn(len(a), 64), torch.randn(len(b), 64)
    tables = [[3, 0, 9], [5, 14]]  # out of order: read through the block table
    # Prefill-like first pass (every row's logits), then one more token each at the next position.
    first = ForwardBatch([a[:6], b[:4]], [0, 0], tables, [6, 4])
    runner.forward(first, torch.cat([ha[:6], hb[:4]]))
    got_first = runner.prenorm
    runner.forward(ForwardBatch([a[6:], b[4:]], [6, 4], tables, [1, 1]), torch.cat([ha[6:], hb[4:]]))
    want_a, want_b = _reference_prenorm(runner.head, a, ha), _reference_prenorm(runner.head, b, hb)
    torch.testing.assert_close(got_first, torch.cat([want_a[:6], want_b[:4]]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(runner.prenorm, torch.stack([want_a[6], want_b[4]]), atol=1e-5, rtol=1e-5)


def test_the_target_hands_over_the_inputs_of_the_heads_layers(model_sets):
    ms = model_sets["qwen2"]
    target = ModelRunner.load(str(ms.target), "float32", "cpu")
    target.allocate_cache(16, 4)
    target.capture_aux((1, 0, 1))
    tokens = [5, 9, 11, 40, 3, 7]
    target.forward(ForwardBatch([tokens], [0], [[2, 1]], [1]))
    model = AutoModelForCausalLM.from_pretrained(ms.target, dtype=torch.float32).eval()
    with torch.inference_mode():
        states = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    want = torch.cat([states[1][0], states[0][0], states[1][0]], dim=-1)
    assert target.aux is not None and target.aux.shape == (6, 3 * 64)
    torch.testing.assert_close(target.aux, want, atol=1e-5, rtol=1e-5)


def _head_kv(head: Eagle3Head, tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K (rotated) and V the head's layer computes at positions 0..T-1: [T, Hkv, D] each."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    layer, attn = head.midlayer, head.midlayer.self_attn
    x = torch.cat([layer.input_layernorm(head.embed(torch.tensor(tokens))), layer.hidden_norm(hidden)], dim=-1)
    k = attn.k_proj(x).view(len(tokens), -1, attn.head_dim).transpose(0, 1)[None]  # [1, Hkv, T, D]
    v = attn.v_proj(x).view(len(tokens), -1, attn.head_dim)
    cos, sin = head.rotary_emb(hidden[None], torch.arange(len(tokens))[None])
    _, k = apply_rotary_pos_emb(k, k, cos, sin)
    return k[0].transpose(0, 1), v


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_heads_cache_equals_a_fresh_pass_over_the_targets_hidden_states(arch, model_sets, head_dir, tokenizer_dir):
    """Prompt lookup and the head draft in turn (hybrid), so the head catches up over positions it did not draft;
    rejected drafts and chain steps wrote the head's cache past num_computed. Whatever happened, the head's
    K/V at every position it counts as computed are those of the target's hidden states and the next token."""
    ms = model_sets[arch]
    llm = LLM(model=str(ms.target), draft_model=str(head_dir), speculative_method="hybrid", num_speculative_tokens=4,
              dtype="float32", device="cpu", block_size=4, prefix_caching=False)
    engine = llm.engine
    for i, p in enumerate(prompts_for(tokenizer_dir)[:6]):
        engine.add_request(str(i), p, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    for _ in range(14):
        engine.step()
    stats = llm.stats()
    by = stats.by_source
    assert by["eagle"].num_draft_tokens > 0 and by["ngram"].num_accepted_tokens > 0, "need both sources drafting"
    source = engine.drafting.source("eagle")
    runner = source.eagle
    model = AutoModelForCausalLM.from_pretrained(ms.target, dtype=torch.float32).eval()
    checked = 0
    for seq in engine.scheduler.running:
        n = seq.draft_num_computed
        if n == 0:
            continue
        with torch.inference_mode():
            states = model(torch.tensor([seq.token_ids[: seq.num_computed]]), output_hidden_states=True).hidden_states
            aux = torch.cat([states[i][0] for i in runner.aux_ids], dim=-1)  # [num_computed, 3H]
            fused = runner.head.fuse(aux)
            want_k, want_v = _head_kv(runner.head, seq.token_ids[1 : n + 1], fused[:n])
            waiting = seq.draft_hidden
            if waiting is not None:  # what waits for the head is the rest of the target's hidden states
                torch.testing.assert_close(waiting, fused[n : n + waiting.shape[0]], atol=1e-5, rtol=1e-5)
        slots = torch.tensor(runner.cache.slots(seq.block_table, 0, n))
        torch.testing.assert_close(runner.cache.k[0][slots], want_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(runner.cache.v[0][slots], want_v, atol=1e-5, rtol=1e-5)
        checked += 1
    assert checked >= 3
    for rid in list(engine.seqs):
        engine.abort(rid)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_method_and_checkpoint_must_agree(model_sets, head_dir):
    ms = model_sets["llama"]
    with pytest.raises(ValueError, match="EAGLE-3 head"):
        LLM(model=str(ms.target), draft_model=str(ms.draft), speculative_method="eagle", device="cpu")
    with pytest.raises(ValueError, match="speculative_method 'eagle'"):
        LLM(model=str(ms.target), draft_model=str(head_dir), speculative_method="draft_model", device="cpu")
    with pytest.raises(ValueError, match="cuda_graphs"):
        LLM(model=str(ms.target), draft_model=str(head_dir), speculative_method="eagle", device="cpu",
            cuda_graphs=True)


def test_chain_drafts_are_the_heads_own_outputs_fed_back(model_sets, head_dir, tokenizer_dir):
    """Each proposal equals the head run from scratch with plain attention: the target's hidden states up to the
    last computed position, then at each further position the previous draft and the head's own pre-norm output
    at the position before (near-ties of the head's logits aside)."""
    ms = model_sets["llama"]
    llm = LLM(model=str(ms.target), draft_model=str(head_dir), speculative_method="eagle", num_speculative_tokens=4,
              dtype="float32", device="cpu")
    source = llm.engine.drafting.source("eagle")
    seen, propose = [], source.propose

    def spy(requests):  # noqa: ANN001, ANN202
        snapshot = [(list(r.seq.token_ids), r.seq.num_computed, r.max_drafts) for r in requests]
        proposal = propose(requests)
        seen.extend((*s, t) for s, t in zip(snapshot, proposal.tokens))
        return proposal

    source.propose = spy
    llm.generate(prompts_for(tokenizer_dir)[:3], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    model = AutoModelForCausalLM.from_pretrained(ms.target, dtype=torch.float32).eval()
    head = source.eagle.head
    chains = 0
    for tokens, nc, k, drafts in seen[::3]:
        assert len(drafts) == k
        with torch.inference_mode():
            states = model(torch.tensor([tokens[:nc]]), output_hidden_states=True).hidden_states
            hidden = head.fuse(torch.cat([states[i][0] for i in source.eagle.aux_ids], dim=-1))  # [nc, H]
            ids = tokens[1 : nc + 1]
            for j, got in enumerate(drafts):
                out = _reference_prenorm(head, ids, hidden)  # [len, H]
                logits = head.logits(out[-1:])[0]
                top = logits.topk(2).values
                if int(logits.argmax()) != got:
                    assert float(top[0] - top[1]) < 1e-4, f"draft {j} differs from the head run from scratch"
                    break
                ids, hidden = ids + [got], torch.cat([hidden, out[-1:]])
            chains += 1
    assert chains >= 4


def test_a_cached_prefix_the_head_never_saw_is_skipped_and_decoding_stays_exact(model_sets, head_dir, tokenizer_dir):
    """The first request drafts nothing (k = 0), so its prompt's blocks are cached for the target but the head
    never computed them. The second finds them in the cache: the target has no hidden states for those
    positions, so the head starts past them; its drafts are still verified, and the output is the target's."""
    ms = model_sets["llama"]
    llm = LLM(model=str(ms.target), draft_model=str(head_dir), speculative_method="eagle", num_speculative_tokens=4,
              dtype="float32", device="cpu", block_size=4)
    engine, prompt = llm.engine, prompts_for(tokenizer_dir)[5]
    plain = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, num_speculative_tokens=0)
    first = llm.generate([prompt], plain)[0].token_ids
    engine.add_request("again", prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    seq = engine.seqs["again"]
    engine.step()  # the rest of the prompt, from the cache's end
    cached = (len(prompt) - 1) // 4 * 4
    assert engine.last_step.prefix_cache_hits == cached > 0 and seq.num_computed == len(prompt)
    assert seq.draft_num_computed == cached and seq.draft_hidden.shape[0] == len(prompt) - cached
    while engine.has_unfinished():
        engine.step()
    assert seq.token_ids[len(prompt) :] == first
    assert llm.stats().num_draft_tokens > 0


def test_a_head_without_an_lm_head_drafts_through_the_targets_own(model_sets, tmp_path):
    """EAGLE-1-style checkpoints carry no LM head: the target's module is shared (not copied)."""
    from safetensors.torch import save_file

    save_eagle_head(tmp_path, seed=2)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["lm_head.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    target = ModelRunner.load(str(model_sets["llama"].target), "float32", "cpu")
    target.allocate_cache(8, 4)
    runner = EagleRunner.load(str(tmp_path), target)
    assert runner.head.lm_head is target.model.get_output_embeddings()
    runner.allocate_cache(8, 4)
    logits = runner.forward(ForwardBatch([[5, 6, 7]], [0], [[1]], [2]), torch.randn(3, 64))
    want = target.model.get_output_embeddings()(runner.head.norm(runner.prenorm))
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(EagleHeadError, match="lm_head.weight"):
        load_head(str(tmp_path), 64, VOCAB)  # and no target head to fall back on
