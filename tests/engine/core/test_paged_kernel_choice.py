"""Which attention the bucketed forwards use: FlexAttention on CUDA only where its kernel compiles."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.core.loader import FLEX_MIN_CUDA_BLOCK, use_paged_kernel
from engine.types.config import EngineConfig


def target_on(device: str) -> SimpleNamespace:
    return SimpleNamespace(device=torch.device(device))  # all use_paged_kernel reads of the runner


@pytest.mark.parametrize(("device", "block", "want"), [("cuda", 16, True), ("cuda", 32, True), ("cuda", 4, False),
                                                       ("cpu", 16, False), ("cpu", 4, False)])
def test_auto_takes_flex_on_cuda_with_blocks_of_sixteen_or_more(device, block, want):
    assert use_paged_kernel(EngineConfig(model="m", block_size=block), target_on(device)) is want


def test_flex_asked_for_with_small_blocks_on_cuda_names_both_settings():
    config = EngineConfig(model="m", block_size=FLEX_MIN_CUDA_BLOCK // 2, paged_attention="flex")
    with pytest.raises(ValueError, match=r"block_size >= 16, got 8.*paged_attention gather"):
        use_paged_kernel(config, target_on("cuda"))
    assert use_paged_kernel(config, target_on("cpu")) is True  # the CPU's flex path takes any block size
