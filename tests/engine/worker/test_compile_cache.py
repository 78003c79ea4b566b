"""A compile cache shipped beside a model (engine.worker.compile_cache): unpacked into inductor's cache where the
machine matches the one it was built on, once; refused, with the difference named, where it does not."""

from __future__ import annotations

import json
import logging
import tarfile
from pathlib import Path

import pytest

from engine.worker import compile_cache


@pytest.fixture
def inductor_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    return cache


def shipped(model: Path, **manifest: str) -> Path:
    """A model directory holding a packed cache of one file, built (says its manifest) on ``manifest``."""
    built = model / "built"
    (built / "fxgraph" / "ab").mkdir(parents=True)
    (built / "fxgraph" / "ab" / "entry").write_text("a compiled graph")
    model.mkdir(exist_ok=True)
    compile_cache.pack(built, model)
    (model / compile_cache.MANIFEST).write_text(json.dumps(compile_cache.machine() | manifest))
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


def test_a_model_without_a_shipped_cache_is_left_alone(tmp_path, inductor_cache):
    assert not compile_cache.seed(tmp_path)


@pytest.mark.parametrize("damage", ["a path outside", "not an archive"])
def test_an_archive_that_cannot_be_unpacked_safely_costs_a_compile_not_the_server(tmp_path, inductor_cache, caplog,
                                                                                  damage):
    model = tmp_path / "model"
    model.mkdir()
    if damage == "a path outside":
        outside = tmp_path / "evil"
        outside.write_text("x")
        with tarfile.open(model / compile_cache.ARCHIVE, "w:xz") as tar:
            tar.add(outside, arcname="../../escaped")
    else:
        (model / compile_cache.ARCHIVE).write_bytes(b"truncated")
    (model / compile_cache.MANIFEST).write_text(json.dumps(compile_cache.machine()))
    assert not compile_cache.seed(model)
    assert "could not be unpacked" in caplog.text
    assert not list(tmp_path.rglob("escaped"))
    assert not compile_cache.seed(model) and caplog.text.count("could not be unpacked") == 2, "no marker was left"


def test_the_embedded_pairs_cache_names_every_field_a_machine_is_checked_on():
    """A manifest missing a field would match any machine on it."""
    manifest = Path(__file__).resolve().parents[3] / "models" / "default" / "target" / compile_cache.MANIFEST
    assert set(json.loads(manifest.read_text())) == set(compile_cache.machine())

