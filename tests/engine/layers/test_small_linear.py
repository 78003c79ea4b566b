"""Linear products on CPU under torch.compile: over one row a fused multiply-reduce, over a few our own kernel
(specd::small_rows_linear), over more oneDNN with packed weights, instead of MKL calls; the same numbers, and
eager code untouched."""

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
def test_compiled_one_row_is_a_fused_loop_a_few_our_kernel_and_more_a_packed_onednn_product(rows):
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
    kernel_calls = sum(src.count("= torch.ops.specd.small_rows_linear.default(") for src in code)
    if rows == 1:
        assert gemm_calls == 0 and packed_calls == 0 and kernel_calls == 0, code
    elif rows <= small_linear.SMALL_ROWS:
        assert gemm_calls == 0 and packed_calls == 0 and kernel_calls == 2, code
    else:  # both layers through oneDNN's packed weights, none through MKL
        assert gemm_calls == 0 and packed_calls >= 2, code


def test_the_few_rows_kernel_is_built_where_there_is_a_compiler():
    # CI has g++: the fast path must not be lost silently to a build failure
    assert small_linear.rows_kernel()


# every tail past one and two whole tiles on either instruction set, and the split itself
@pytest.mark.parametrize("rows", [*range(2, 26), small_linear.SMALL_ROWS - 1, small_linear.SMALL_ROWS])
@pytest.mark.parametrize(("k", "n"), [(384, 1024), (1024, 384), (37, 10), (5, 35)])
def test_the_few_rows_kernel_is_the_linear_product_for_every_tile_and_tail(rows, k, n):
    # rows past a whole tile (6 on AVX2, 12 on AVX-512) take a smaller one; outputs past a whole panel of 16 come
    # from a panel padded with zeros, and only the real ones are written
    assert small_linear.rows_kernel()
    g = torch.Generator().manual_seed(rows * 1000 + k)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    op, panels = torch.ops.specd.small_rows_linear, small_linear.pack(w)
    assert panels.shape == (-(-n // small_linear.PANEL), k, small_linear.PANEL)
    torch.testing.assert_close(op(x, panels, None, n), x @ w.t(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(op(x, panels, b, n), torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-5)
    wide = torch.randn(rows, 2 * k, generator=g)[:, ::2]  # not contiguous
    torch.testing.assert_close(op(wide, panels, None, n), wide @ w.t(), atol=1e-4, rtol=1e-5)


def test_the_few_rows_kernel_refuses_mismatched_shapes_and_dtypes():
    assert small_linear.rows_kernel()
    op, panels = torch.ops.specd.small_rows_linear, small_linear.pack(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="against weight panels of"):
        op(torch.randn(3, 9), panels, None, 20)
    with pytest.raises(RuntimeError, match="outputs from weight panels"):
        op(torch.randn(3, 8), panels, None, 16)  # a whole panel of nothing
    with pytest.raises(RuntimeError, match="float32"):
        op(torch.randn(3, 8, dtype=torch.float64), panels.double(), None, 20)
    with pytest.raises(RuntimeError, match="bias"):
        op(torch.randn(3, 8), panels, torch.randn(5), 20)
