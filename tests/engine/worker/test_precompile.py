"""Graphs compiled in a child process (engine.worker.precompile, engine.worker.aot_graphs): what tells their
layouts apart once dynamo's identity guards are dropped, what their files are keyed by, and the packed layers'
keys across processes. The child itself, serving and lossless, is pinned in test_compile.py (its background
compile goes through it)."""

from __future__ import annotations

import os
import types

import torch
from torch import nn

from engine.layers import small_linear
from engine.layers.attention_metadata import ShortGroup
from engine.worker import aot_graphs, precompile


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


def fake_runner(path) -> types.SimpleNamespace:
    return types.SimpleNamespace(name=str(path), cache=types.SimpleNamespace(block_size=16))


def test_the_graphs_file_changes_with_the_checkpoint_the_layouts_and_the_dtype(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x" * 8)
    runner = fake_runner(tmp_path)
    first = precompile.key(runner, 4, "float32")
    assert precompile.key(runner, 4, "float32") == first
    assert precompile.key(runner, 5, "float32") != first
    assert precompile.key(runner, 4, "bfloat16") != first
    os.utime(tmp_path / "model.safetensors", ns=(1, 1))  # new weights: a new file
    assert precompile.key(runner, 4, "float32") != first


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
