"""When a precompiled graph may call inductor's function past AOTAutograd's runtime wrapper
(engine.worker.kernel_call): only where that wrapper would hand the call through unchanged. A real graph's direct
call is checked against torch's own in tests/engine/worker/test_compile.py."""

from __future__ import annotations

import types

import pytest

from engine.worker.kernel_call import call_kernel_directly, passes_through

# What the wrapper of an engine forward's graph is told at compile time: nothing to write back, rebuild or thread.
PLAIN = dict(num_mutated_inp_runtime_indices=0, num_outputs_aliased=0, num_intermediate_bases=0,
             grad_enabled_mutation=None, is_rng_op_functionalized=False, tokens={}, num_unsafe_view_outputs=0,
             traced_tangents=[])


def test_a_graph_with_nothing_to_write_back_rebuild_or_thread_passes_through() -> None:
    assert passes_through(types.SimpleNamespace(**PLAIN))


@pytest.mark.parametrize(("field", "value"), [
    ("num_mutated_inp_runtime_indices", 1),  # an input the wrapper copies the graph's new value into
    ("num_outputs_aliased", 1),  # an output it rebuilds as a view of an input
    ("num_intermediate_bases", 1),
    ("grad_enabled_mutation", True),  # the graph turned grad mode on: the wrapper sets it after
    ("is_rng_op_functionalized", True),  # the wrapper feeds the generator's state in and out
    ("tokens", {0: object()}),  # effect tokens
    ("num_unsafe_view_outputs", 1),
    ("traced_tangents", [object()]),  # a graph traced for a backward
])
def test_a_graph_whose_wrapper_has_work_to_do_keeps_torchs_call(field: str, value: object) -> None:
    assert not passes_through(types.SimpleNamespace(**{**PLAIN, field: value}))


def test_a_graph_laid_out_otherwise_is_left_as_it_was() -> None:
    """Not dynamo's AOTCompiledFunction as this torch builds it (here, no bytecode globals naming the wrapper)."""
    scope = {"backend": lambda *args: args}
    fn = types.SimpleNamespace(fn=types.SimpleNamespace(__globals__=scope),
                               _artifacts=types.SimpleNamespace(backend_id="backend"))
    before = dict(scope)
    assert not call_kernel_directly(fn)
    assert scope == before
