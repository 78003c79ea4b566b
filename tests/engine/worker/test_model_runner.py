"""transformers' own models on a packed, paged batch give the logits of a plain forward."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, BertConfig, BertModel

from engine.worker.forward_batch import ForwardBatch
from engine.worker.loading import UnsupportedModelError
from engine.worker.model_runner import ModelRunner
from tests.tiny_models import ARCHS


def _tables(lengths, block_size):
    tables, nxt = [], 0
    for n in lengths:
        need = -(-n // block_size)
        tables.append(list(range(nxt + need - 1, nxt - 1, -1)))  # deliberately out of order
        nxt += need
    return tables


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_paged_chunks_give_the_unpacked_logits(arch, model_sets):
    """Three sequences fed in two steps: a long fresh prefill, then a mix of long and short
    continuations (the batched short-query path and the per-sequence path) over a paged cache
    whose blocks are scattered; the mistral config's sliding window is shorter than the context."""
    path = model_sets[arch].target
    runner = ModelRunner.load(str(path), "float32", "cpu")
    runner.allocate_cache(num_blocks=40, block_size=4)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (70, 12, 45)]
    tables = _tables([len(s) for s in seqs], 4)
    split = [33, 11, 5]  # second step feeds 37 (long), 1 (decode) and 40 (long) tokens
    runner.forward(ForwardBatch([s[:k] for s, k in zip(seqs, split)], [0, 0, 0], tables, [0, 0, 0]))
    rest = [s[k:] for s, k in zip(seqs, split)]
    logits = runner.forward(ForwardBatch(rest, split, tables, [len(r) for r in rest]))
    row = 0
    for s, k in zip(seqs, split):
        with torch.no_grad():
            want = ref(torch.tensor([s])).logits[0, k:]
        got = logits[row : row + len(s) - k]
        row += len(s) - k
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_short_queries_share_one_padded_call_with_the_same_logits(model_sets):
    path = model_sets["llama"].target
    runner = ModelRunner.load(str(path), "float32", "cpu")
    runner.allocate_cache(num_blocks=40, block_size=4)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seqs = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39]]
    tables = _tables([len(s) for s in seqs], 4)
    split = [4, 1, 9]  # then 3, 2 and 1 new tokens: one padded [3, 3] query group
    runner.forward(ForwardBatch([s[:k] for s, k in zip(seqs, split)], [0, 0, 0], tables, [0, 0, 0]))
    rest = [s[k:] for s, k in zip(seqs, split)]
    logits = runner.forward(ForwardBatch(rest, split, tables, [len(r) for r in rest]))
    want = torch.cat([ref(torch.tensor([s])).logits[0, k:] for s, k in zip(seqs, split)]).detach()
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)


def test_unsupported_architecture_is_a_clear_error_naming_it(tmp_path):
    BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="Bert.*bidirectional"):
        ModelRunner.load(str(tmp_path), "float32", "cpu")


def test_attention_soft_capping_is_refused_rather_than_ignored(tmp_path):
    from transformers import Gemma2Config

    cfg = Gemma2Config(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, intermediate_size=32, head_dim=8)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="soft-capping"):
        ModelRunner.load(str(tmp_path), "float32", "cpu")


def test_decoder_layers_that_drop_keyword_arguments_are_refused_at_load(tmp_path):
    """Nemotron's decoder layer does not pass keyword arguments on to attention, so the paged cache's
    metadata would never arrive: refused at load, naming why, not at the first request."""
    from transformers import NemotronConfig

    cfg = NemotronConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=32, head_dim=8)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="Nemotron.*keyword arguments"):
        ModelRunner.load(str(tmp_path), "float32", "cpu")


def test_values_with_their_own_head_size_run_exactly(tmp_path):
    """DeepSeek-V2's attention: queries and keys of 12 (8 + 4 rotary), values of 16. The V cache is sized
    from the values and the paged logits equal transformers' own."""
    from transformers import DeepseekV2Config

    torch.manual_seed(0)
    cfg = DeepseekV2Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                           kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=16,
                           n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                           max_position_embeddings=128)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    runner = ModelRunner.load(str(tmp_path), "float32", "cpu")
    assert {(s.head_dim, s.v_head_dim) for s in runner.layer_shapes} == {(12, 16)}
    runner.allocate_cache(num_blocks=20, block_size=4)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    seqs = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 24]]
    tables = _tables([len(s) for s in seqs], 4)
    split = [6, 4]  # a prefill, then 3 and 1 new tokens through the cache
    runner.forward(ForwardBatch([s[:k] for s, k in zip(seqs, split)], [0, 0], tables, [0, 0]))
    rest = [s[k:] for s, k in zip(seqs, split)]
    logits = runner.forward(ForwardBatch(rest, split, tables, [len(r) for r in rest]))
    with torch.no_grad():
        want = torch.cat([ref(torch.tensor([s])).logits[0, k:] for s, k in zip(seqs, split)])
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
