"""Graphs compiled in a child process (engine.worker.precompile, engine.worker.aot_graphs): what tells their
layouts apart once dynamo's identity guards are dropped, what their files are keyed by, and the packed layers'
keys across processes. The child itself, serving and lossless, is pinned in test_compile.py (its background
compile goes through it)."""

from __future__ import annotations

import logging
import os
import pickle
import types

import torch
from torch import nn

from engine.layers import small_linear
from engine.layers.attention_metadata import ShortGroup
from engine.worker import aot_graphs, graph_files, precompile


def short(mask: torch.Tensor | None, span: tuple[int, int] | None) -> ShortGroup:
    t = torch.zeros(2, dtype=torch.long)
    return ShortGroup(rows=None, real=None, real_rows=None, positions=t, slots=t, mask=mask, span=span)


def test_the_structure_tells_a_missing_mask_or_span_from_a_present_one_and_ignores_sizes():
    masked, plain = short(torch.ones(1, dtype=torch.bool), None), short(None, None)
    spanned = short(None, (0, 4))
    shapes = {aot_graphs.structure(x) for x in (masked, plain, spanned)}
    assert len(shapes) == 3
    bigger = ShortGroup(rows=None, real=None, real_rows=None, positions=torch.zeros(9, dtype=torch.long),
                        slots=torch.zeros(9, dtype=torch.long), mask=torch.ones(3, dtype=torch.bool), span=None)
    assert aot_graphs.structure(bigger) == aot_graphs.structure(masked), "sizes are the kept guards' to check"
    assert aot_graphs.structure([masked, masked]) != aot_graphs.structure([masked])


def fake_runner(path, dtype: torch.dtype = torch.float32) -> types.SimpleNamespace:
    return types.SimpleNamespace(name=str(path), dtype=dtype, cache=types.SimpleNamespace(block_size=16))


def test_the_graphs_file_changes_with_the_checkpoint_the_layouts_and_the_dtype_not_with_where_it_lies(tmp_path):
    """Keyed by the dtype the model loaded in, not the flag's spelling: a server given --dtype float32 found no
    file where the shipped ones were built under "auto", the same float32 on CPU, and compiled for 12 minutes."""
    for where in ("a", "b"):  # one checkpoint, in two clones
        (tmp_path / where).mkdir()
        (tmp_path / where / "config.json").write_text("{}")
        (tmp_path / where / "model.safetensors").write_bytes(b"x" * 8)
    runner = fake_runner(tmp_path / "a")
    first = graph_files.key(runner, 4)
    assert graph_files.key(fake_runner(tmp_path / "b"), 4) == first, "a clone loads the graphs"
    os.utime(tmp_path / "a" / "model.safetensors", ns=(1, 1))
    assert graph_files.key(runner, 4) == first, "a checkout's file times are not the checkpoint"
    assert graph_files.key(runner, 5) != first
    assert graph_files.key(fake_runner(tmp_path / "a", torch.bfloat16), 4) != first
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # the graphs' guards check it
        assert graph_files.key(runner, 4) != first
    finally:
        torch.set_num_threads(threads)
    (tmp_path / "a" / "model.safetensors").write_bytes(b"y" * 8)  # other weights: their layers' keys differ
    assert graph_files.key(runner, 4) != first
    (tmp_path / "a" / "model.safetensors").write_bytes(b"x" * 8)
    (tmp_path / "a" / "config.json").write_text('{"num_hidden_layers": 2}')
    assert graph_files.key(runner, 4) != first


def graphs_traced_from(module: str, first: int, last: int, checksum: str) -> bytes:
    return pickle.dumps({"sources": [(module, first, last, checksum)], "graphs": []})


def test_graphs_whose_traced_code_changed_are_stale_and_compiled_again(tmp_path, monkeypatch, caplog):
    """A graph runs the code as it was traced: a file whose traced lines differ from this process's is not used."""
    from torch._dynamo.package import _hash_source

    caplog.set_level(logging.INFO, logger="engine.worker.precompile")
    code = "def forward(x):\n    return x + 1\n"
    (tmp_path / "traced_here.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = graphs_traced_from("traced_here", 1, 3, _hash_source(code))
    assert aot_graphs.stale(data) == ""
    path = tmp_path / "graphs.bin"
    path.write_bytes(data)
    assert precompile.current(path)

    (tmp_path / "traced_here.py").write_text(code.replace("x + 1", "x + 2"))
    os.utime(tmp_path / "traced_here.py", ns=(2, 2))  # what linecache looks at to read a file again
    assert aot_graphs.stale(data) == "traced_here, lines 1-3"
    assert not precompile.current(path) and "stale (traced_here, lines 1-3)" in caplog.text
    assert aot_graphs.stale(graphs_traced_from("gone_module", 1, 3, "0")) == "gone_module, lines 1-3"
    path.write_bytes(b"not a pickle")
    assert not precompile.current(path) and "unreadable" in caplog.text
    assert not precompile.current(tmp_path / "missing.bin")


def test_packed_layers_take_the_stable_keys_unless_another_model_holds_them():
    assert torch.backends.mkldnn.is_available(), "the CPU wheel packs with oneDNN"
    torch.manual_seed(0)
    here = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    assert small_linear.install(here) == 2
    assert small_linear.rekey(here, "model-a")
    key = small_linear.stable_key("model-a", "1")
    assert here[1].packed_key == key and small_linear._PACKED[key] is here[1].packed
    assert small_linear.rekey(here, "model-a"), "twice for the same layers is fine"
    other = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    small_linear.install(other)
    before = other[1].packed_key
    assert not small_linear.rekey(other, "model-a"), "the keys are another live model's"
    assert other[1].packed_key == before
    child = nn.Sequential(nn.Linear(8, 8))
    small_linear.install(child, "model-b")
    assert child[0].packed_key == small_linear.stable_key("model-b", "0")
