"""Configurations tensor parallelism cannot serve are refused before anything loads, each with the way out."""

from __future__ import annotations

import pytest

from engine import EngineConfig
from engine.parallel.checks import TensorParallelError, check_target
from tests.tiny_models import tiny_config


@pytest.mark.parametrize(("options", "message"), [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1"),
    (dict(device_map="auto"), "give one"),
    (dict(compile="start"), "use compile 'off' or 'auto'"),
    (dict(compile="background"), "use compile 'off' or 'auto'"),
    (dict(cuda_graphs=True), "cuda_graphs is not available"),
    (dict(speculative_method="self", draft_layers=1), "self-speculation (draft_layers) is not available"),
])
def test_options_tensor_parallelism_cannot_combine_with_are_refused(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(model="m", **{"tensor_parallel_size": 2, **options})


def test_one_rank_takes_every_option():
    EngineConfig(model="m", tensor_parallel_size=1, compile="start", device_map="auto")


def test_a_size_that_does_not_divide_the_heads_names_the_sizes_that_do():
    with pytest.raises(TensorParallelError, match=r"4 attention heads and 2 KV heads: use one of \[2\]"):
        check_target(4, tiny_config("llama"), "cpu", None)


def test_an_architecture_without_a_tensor_parallel_plan_cannot_be_sharded():
    with pytest.raises(TensorParallelError, match="GPT2LMHeadModel|gpt2.*cannot be sharded"):
        check_target(2, tiny_config("gpt2"), "cpu", None)


def test_more_ranks_than_gpus_is_refused_unless_planning_for_another_machine():
    with pytest.raises(TensorParallelError, match="needs 2 GPUs, one per rank; this machine has 1"):
        check_target(2, tiny_config("llama"), "cuda", 1)
    check_target(2, tiny_config("llama"), "cuda", None)  # --dry-run --device-memory: another machine's GPUs


def test_an_eagle_head_cannot_draft_for_a_sharded_target():
    with pytest.raises(TensorParallelError, match="EAGLE head reads the target's hidden states"):
        check_target(2, tiny_config("llama"), "cpu", None, eagle=True)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "qwen2", "gemma"])
def test_architectures_with_a_plan_and_whole_heads_pass(arch):
    check_target(2, tiny_config(arch), "cpu", None)
