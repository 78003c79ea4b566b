"""Linear products on CPU under torch.compile: over a few rows a fused multiply-reduce, over more oneDNN with
packed weights, instead of MKL calls; the same numbers, and eager code untouched."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

from engine.layers import small_linear
from engine.layers.tracing import compiled_call


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(24, 40)
        self.b = nn.Linear(40, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_install_turns_only_float32_cpu_linears_and_keeps_the_eager_forward():
    torch.manual_seed(0)
    model, half = Two(), nn.Linear(8, 8).to(torch.bfloat16)
    x = torch.randn(1, 3, 24)
    want = model(x)
    assert small_linear.install(model) == 2 and small_linear.install(half) == 0
    assert type(model.a) is small_linear.SmallRowsLinear and type(half) is nn.Linear
    assert torch.equal(model(x), want)  # outside torch.compile: F.linear itself
    assert set(model.state_dict()) == {"a.weight", "a.bias", "b.weight"}


@pytest.mark.parametrize("rows", [1, 3, small_linear.SMALL_ROWS, small_linear.SMALL_ROWS + 1])
def test_compiled_few_rows_are_a_fused_loop_and_more_rows_a_packed_onednn_product(rows):
    torch.manual_seed(0)
    model = Two()
    x = torch.randn(1, rows, 24)
    want = model(x)
    small_linear.install(model)
    torch._dynamo.reset()
    # as the engine runs its forwards: in inference mode, the call marked as a compiled one (engine.layers.tracing)
    with torch.inference_mode(), compiled_call():
        got, code = run_and_get_code(torch.compile(model, dynamic=True), x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    gemm_calls = sum(src.count("mm(") for src in code)
    packed_calls = sum(src.count("packed_linear") for src in code)
    if rows <= small_linear.SMALL_ROWS:
        assert gemm_calls == 0 and packed_calls == 0, code
    else:  # both layers through oneDNN's packed weights, none through MKL
        assert gemm_calls == 0 and packed_calls >= 2, code
