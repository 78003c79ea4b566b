"""compile_with_limit on a torch whose torch.compile takes no recompile_limit (2.11, the GPU images')."""

from __future__ import annotations

import torch

from engine.layers import compile_limit


def test_without_the_keyword_the_limit_holds_inside_each_call_and_the_result_is_the_function(monkeypatch):
    monkeypatch.setattr(compile_limit, "TAKES_LIMIT", False)
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    seen = []

    def double(x: torch.Tensor) -> torch.Tensor:
        seen.append(getattr(config, name))  # read while dynamo traces the function, under the patch
        return x * 2

    before = getattr(config, name)
    fn = compile_limit.compile_with_limit(double, before + 56, backend="eager")
    assert torch.equal(fn(torch.arange(3)), torch.arange(3) * 2)
    assert seen and seen[0] == before + 56
    assert getattr(config, name) == before  # nothing left behind outside the call
    assert fn.__name__ == "double"
