"""Compile caches shipped beside a model (engine.worker.compile_cache): the one built on a machine like this one
unpacked into inductor's cache, once; the others refused, with the difference named. And inductor's cache keyed by
the engine code a graph is built from."""

from __future__ import annotations

import json
import logging
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.worker import compile_cache


@pytest.fixture
def inductor_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    return cache


def shipped(model: Path, text: str = "a compiled graph", **manifest: str) -> Path:
    """A model directory holding a packed cache of one file (``text``), built (says its manifest) on ``manifest``
    (this machine, but for the fields given)."""
    built = model / f"built-{len(list(model.glob('built-*'))) if model.exists() else 0}"
    (built / "fxgraph" / "ab").mkdir(parents=True)
    (built / "fxgraph" / "ab" / "entry").write_text(text)
    packed = compile_cache.archive(model, compile_cache.machine() | manifest)
    with tarfile.open(packed, "w:xz") as tar:
        tar.add(built / "fxgraph", arcname="fxgraph")
    compile_cache.manifest(packed).write_text(json.dumps(compile_cache.machine() | manifest))
    return model


def test_a_cache_built_on_a_machine_like_this_one_is_unpacked_once(tmp_path, inductor_cache):
    model = shipped(tmp_path / "model")
    assert compile_cache.seed(model)
    assert (inductor_cache / "fxgraph" / "ab" / "entry").read_text() == "a compiled graph"
    assert not compile_cache.seed(model), "the same archive again: nothing to do"


@pytest.mark.parametrize("field", ["torch", "isa", "cxx", "python", "machine"])
def test_a_cache_built_elsewhere_is_not_used_and_the_log_says_what_differs(tmp_path, inductor_cache, caplog, field):
    caplog.set_level(logging.INFO, "engine.worker.compile_cache")
    model = shipped(tmp_path / "model", **{field: "something else"})
    assert not compile_cache.seed(model)
    assert not (inductor_cache / "fxgraph").exists()
    assert f"{field} 'something else'" in caplog.text and "compiling from scratch" in caplog.text


def test_of_caches_built_on_several_kinds_of_cpu_the_one_for_this_machine_is_unpacked(tmp_path, inductor_cache,
                                                                                       caplog):
    caplog.set_level(logging.INFO, "engine.worker.compile_cache")
    model = shipped(tmp_path / "model", "another CPU's graph", isa="sve256")
    assert len(compile_cache.shipped(model)) == 1 and not compile_cache.seed(model)
    assert "compile-cache-sve256.tar.xz: isa 'sve256'" in caplog.text
    shipped(model, "this CPU's graph")
    assert len(compile_cache.shipped(model)) == 2 and compile_cache.seed(model)
    assert (inductor_cache / "fxgraph" / "ab" / "entry").read_text() == "this CPU's graph"


def test_packing_for_this_machine_leaves_the_cache_another_kind_of_cpu_built(tmp_path, inductor_cache):
    model = shipped(tmp_path / "model", "another CPU's graph", isa="sve256")
    cache = tmp_path / "compiled"
    (cache / "fxgraph").mkdir(parents=True)
    (cache / "fxgraph" / "entry").write_text("this CPU's graph")
    (cache / compile_cache.PRECOMPILED).mkdir()
    (cache / compile_cache.PRECOMPILED / "graphs.bin").write_bytes(b"graphs")
    (cache / compile_cache.PRECOMPILED / "graphs.bin.lock").touch()  # a compile's lock (engine.worker.compile_lock)
    packed = compile_cache.pack(cache, model)
    assert packed == compile_cache.archive(model)
    with tarfile.open(packed) as tar:
        assert sorted(tar.getnames()) == ["fxgraph", "fxgraph/entry", compile_cache.PRECOMPILED,
                                          f"{compile_cache.PRECOMPILED}/graphs.bin"], "no lock shipped"
    assert {built["isa"] for _, built in compile_cache.shipped(model)} == {"sve256", compile_cache.machine()["isa"]}


def test_a_model_without_a_shipped_cache_is_left_alone(tmp_path, inductor_cache):
    assert not compile_cache.seed(tmp_path)


@pytest.mark.parametrize("damage", ["a path outside", "not an archive", "cut short"])
def test_an_archive_that_cannot_be_unpacked_safely_costs_a_compile_not_the_server(tmp_path, inductor_cache, caplog,
                                                                                  damage):
    model = tmp_path / "model"
    model.mkdir()
    if damage == "a path outside":
        outside = tmp_path / "evil"
        outside.write_text("x")
        with tarfile.open(compile_cache.archive(model), "w:xz") as tar:
            tar.add(outside, arcname="../../escaped")
    elif damage == "cut short":  # read while another process wrote it: lzma's EOFError, not a TarError
        (tmp_path / "graph").write_bytes(bytes(range(256)) * 4096)
        with tarfile.open(compile_cache.archive(model), "w:xz") as tar:
            tar.add(tmp_path / "graph", arcname="graph")
        whole = compile_cache.archive(model).read_bytes()
        compile_cache.archive(model).write_bytes(whole[: len(whole) // 2])
    else:
        compile_cache.archive(model).write_bytes(b"truncated")
    compile_cache.manifest(compile_cache.archive(model)).write_text(json.dumps(compile_cache.machine()))
    assert not compile_cache.seed(model)
    assert "could not be unpacked" in caplog.text
    assert not list(tmp_path.rglob("escaped"))
    assert not compile_cache.seed(model) and caplog.text.count("could not be unpacked") == 2, "no marker was left"


def test_the_embedded_pairs_caches_name_every_field_a_machine_is_checked_on():
    """A manifest missing a field would match any machine on it."""
    caches = compile_cache.shipped(Path(__file__).resolve().parents[3] / "models" / "default" / "target")
    assert caches, "the embedded pair ships no compile cache"
    for packed, built in caches:
        assert set(built) == set(compile_cache.machine()), packed.name
        assert packed == compile_cache.archive(packed.parent, built), "named for another CPU than it was built on"


@pytest.fixture
def engine_copy(tmp_path, monkeypatch) -> Iterator[Path]:
    """A copy of the engine files a graph is built from, read in place of the checkout's."""
    root = tmp_path / "engine"
    for part in compile_cache.BUILT_FROM:
        source = compile_cache.ENGINE_ROOT / part
        if source.is_dir():
            shutil.copytree(source, root / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (root / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / part)
    monkeypatch.setattr(compile_cache, "ENGINE_ROOT", root)
    compile_cache.engine_source.cache_clear()
    with torch.compiler.config.patch(cache_key_tag=""):  # the process's own tag after the test
        yield root
    compile_cache.engine_source.cache_clear()  # the checkout's again


def test_inductors_caches_are_keyed_by_the_code_that_shapes_the_graphs(engine_copy):
    """A cached graph brings back the shape guards it was compiled under: one cached at a split of 16 rows kept a
    32-sequence decode eager in every graph compiled over it after the split moved to 128. A change to that code
    keys the cache apart; anything else (the server, the scheduler) leaves it shared."""
    compile_cache.tag_caches()
    first = torch.compiler.config.cache_key_tag
    assert first == f"specd-{compile_cache.engine_source()[:16]}"
    small_linear = engine_copy / "layers" / "small_linear.py"
    text = small_linear.read_text()
    assert "SMALL_ROWS = 128" in text
    small_linear.write_text(text.replace("SMALL_ROWS = 128", "SMALL_ROWS = 16"))
    compile_cache.engine_source.cache_clear()
    compile_cache.tag_caches()
    assert torch.compiler.config.cache_key_tag != first
    small_linear.write_text(text)
    compile_cache.engine_source.cache_clear()
    compile_cache.tag_caches()
    assert torch.compiler.config.cache_key_tag == first


def test_a_model_compiled_in_this_process_compiles_under_the_tag(engine_copy):
    from engine.worker.compiled import CompiledForward

    CompiledForward(torch.nn.Sequential(torch.nn.Linear(4, 4)), "tiny")
    assert torch.compiler.config.cache_key_tag == f"specd-{compile_cache.engine_source()[:16]}"
