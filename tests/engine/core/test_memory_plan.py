"""The memory plan's arithmetic: what the KV cache gets, the context it allows, and the errors a start stops with."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from engine import LLM, EngineConfig, LLMEngine
from engine.core.memory_plan import GiB, ModelSize, PlanError, PlanRequest, activation_bytes, parse_size, plan_memory

# Llama-3.1-8B and 3.2-1B in bf16: weights, and KV bytes per 16-token block (layers x KV heads x head dim x 2 x 2 B).
TARGET = ModelSize(16_060_522_496, 16 * 32 * 8 * 128 * 2 * 2, 4096, 14336, 128256)
DRAFT = ModelSize(2_471_628_800, 16 * 16 * 8 * 64 * 2 * 2, 2048, 8192, 128256)
BASE = PlanRequest(device="cuda", memory_bytes=80 * GiB, share=None, target=TARGET, draft=DRAFT, dtype_bytes=2,
                   block_size=16, k_max=8, max_num_seqs=64, max_num_batched_tokens=2048, model_limit=131072,
                   max_model_len=None, cuda_graphs=True)


def blocks_for(tokens: int, k: int = 8) -> int:
    return -(-(tokens + k + 1) // 16)


def test_on_cuda_the_kv_cache_gets_the_share_left_after_weights_and_activations():
    plan = plan_memory(dataclasses.replace(BASE, max_model_len=8192))
    left = int(0.9 * 80 * GiB) - TARGET.weight_bytes - DRAFT.weight_bytes - activation_bytes(BASE)
    want = min(left // (TARGET.block_bytes + DRAFT.block_bytes), 64 * blocks_for(8192))
    assert plan.num_blocks == want and plan.max_model_len == 8192 and not plan.warnings
    assert plan.weight_bytes + plan.activation_bytes + plan.kv_bytes <= 0.9 * 80 * GiB


def test_an_unset_context_is_capped_so_that_four_full_length_sequences_fit_and_says_so():
    plan = plan_memory(BASE)
    assert 32768 <= plan.max_model_len < 131072 and plan.max_model_len % 16 == 0
    assert plan.num_blocks >= 4 * blocks_for(plan.max_model_len) and plan.full_length_sequences >= 4
    assert len(plan.warnings) == 1 and "max_model_len capped" in plan.warnings[0]
    roomy = plan_memory(dataclasses.replace(BASE, memory_bytes=1024 * GiB))
    assert roomy.max_model_len == 131072 and not roomy.warnings  # where the whole limit fits 4 times, no cap


def test_an_explicit_context_that_cannot_fit_names_the_largest_that_does_and_that_one_fits():
    small = dataclasses.replace(BASE, memory_bytes=24 * GiB, max_model_len=131072)
    with pytest.raises(PlanError, match=r"largest max_model_len that fits is (\d+)") as err:
        plan_memory(small)
    largest = int(err.value.args[0].rsplit(" ", 1)[1])
    assert plan_memory(dataclasses.replace(small, max_model_len=largest)).max_model_len == largest
    with pytest.raises(PlanError):
        plan_memory(dataclasses.replace(small, max_model_len=largest + 16))


def test_weights_beyond_the_device_exit_with_the_shortfall_and_the_way_out():
    seventy = ModelSize(141_107_412_992, 16 * 80 * 8 * 128 * 2 * 2, 8192, 28672, 128256)
    with pytest.raises(PlanError, match=r"short by \d+\.\d GiB.*--device-map auto.*quantised"):
        plan_memory(dataclasses.replace(BASE, target=seventy, draft=None))


def test_an_explicit_kv_budget_that_does_not_fit_beside_the_weights_is_refused_on_cuda():
    with pytest.raises(PlanError, match=r"kv_cache_memory_gb 20 does not fit .* at most \d+\.\d fits"):
        plan_memory(dataclasses.replace(BASE, memory_bytes=24 * GiB, kv_cache_bytes=20 * GiB))
    plan = plan_memory(dataclasses.replace(BASE, kv_cache_bytes=2 * GiB, max_model_len=4096))
    assert plan.num_blocks == 2 * GiB // (TARGET.block_bytes + DRAFT.block_bytes)


def test_on_cpu_the_kv_cache_gets_a_quarter_of_the_ram_besides_the_weights():
    tiny = ModelSize(10 * 2**20, 64 * 1024, 256, 512, 1000)
    plan = plan_memory(dataclasses.replace(BASE, device="cpu", memory_bytes=2 * GiB, target=tiny, draft=None,
                                           model_limit=4096, max_num_seqs=1024))
    assert plan.num_blocks == int(0.25 * (2 * GiB - tiny.weight_bytes)) // tiny.block_bytes
    assert plan.share == 0.25 and plan.max_model_len == 4096


def test_an_explicit_block_count_is_kept_and_never_caps_the_context():
    plan = plan_memory(dataclasses.replace(BASE, num_kv_blocks=blocks_for(131072)))
    assert plan.num_blocks == blocks_for(131072) and plan.max_model_len == 131072 and not plan.warnings


def test_a_split_target_plans_its_kv_budget_alone_and_says_so():
    plan = plan_memory(dataclasses.replace(BASE, memory_bytes=1 * GiB, kv_cache_bytes=GiB, split=True,
                                           max_model_len=4096))
    assert plan.num_blocks > 0 and "split across devices" in plan.warnings[0]


@pytest.mark.parametrize(("text", "size"), [("80GiB", 80 * GiB), ("24 GB", 24 * 10**9), ("512MiB", 512 * 2**20),
                                            ("1.5GiB", 3 * GiB // 2), ("4096", 4096)])
def test_memory_sizes_parse_with_binary_and_decimal_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "eighty", "-1GiB", "80XB", "0"])
def test_a_memory_size_that_is_not_one_names_itself(text):
    with pytest.raises(ValueError, match="not a memory size"):
        parse_size(text)


def test_a_real_start_plans_from_the_loaded_models_and_stops_where_the_share_leaves_no_cache(model_sets, caplog):
    target = str(model_sets["llama"].target)
    with caplog.at_level(logging.INFO, logger="engine.core.loader"):
        llm = LLM(model=target, speculative_method="none", dtype="float32", device="cpu", memory_utilization=0.5)
    plan = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("memory plan"))
    assert "0.5 of it (less the weights) for the KV cache" in plan and "full-length sequences fit at once" in plan
    assert llm.engine.block_manager.num_blocks > 0
    with pytest.raises(PlanError, match="does not fit"):
        LLMEngine(EngineConfig(model=target, speculative_method="none", dtype="float32", device="cpu",
                               memory_utilization=1e-9))
