"""engine.layers.tracing: eager code in one thread keeps its eager branches while another thread compiles (torch holds
torch.compiler.is_compiling() True for the whole process during a compile)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import small_linear
from engine.layers.tracing import compiled_call, tracing


def test_a_compile_elsewhere_in_the_process_does_not_make_eager_code_take_the_traced_branch():
    torch.manual_seed(0)
    layer = nn.Linear(24, 40)
    small_linear.install(layer)
    x = torch.randn(1, 5, 24)
    want = F.linear(x, layer.weight, layer.bias)
    # what a compile in another thread does to the process: torch.compiler.is_compiling() is True everywhere
    with torch.compiler._compile_session_context(), torch.inference_mode():
        assert torch.compiler.is_compiling()
        assert not tracing()
        assert torch.equal(layer(x), want)  # F.linear itself, not the fused loop run eagerly
        with compiled_call():
            assert tracing()  # the thread that entered a compiled forward is the one tracing it
        assert not tracing()


def test_a_compiled_forward_marks_its_own_thread_only():
    seen: list[bool] = []

    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(tracing())  # read while dynamo traces: folded into the graph
        return x + 1

    compiled = torch.compile(probe, backend="eager", fullgraph=True)
    with compiled_call():
        compiled(torch.ones(2))
    compiled_outside = torch.compile(lambda x: x * 2 if tracing() else x, backend="eager", fullgraph=True)
    assert seen == [True]
    assert torch.equal(compiled_outside(torch.ones(2)), torch.ones(2))  # not through compiled_call: not tracing
