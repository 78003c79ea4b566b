"""Building our C sources (engine.native.build): once per source and flags, cached, and a clean None where the
machine cannot build them, so each caller keeps its fallback."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine.native.build import library, operators


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kernels"


def test_a_source_is_built_once_and_then_loaded_from_the_cache(tmp_path: Path, cache: Path):
    source = tmp_path / "twice.c"
    source.write_text("long twice(long x) { return 2 * x; }\n")
    lib = library(source, ["-O2", "-fPIC"], ["-shared"], "a test library")
    assert lib is not None and lib.twice(21) == 42
    built = sorted(cache.glob("twice-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    assert library(source, ["-O2", "-fPIC"], ["-shared"], "a test library").twice(5) == 10
    assert built[0].stat().st_mtime_ns == mtime and sorted(cache.glob("twice-*.so")) == built
    source.write_text("long twice(long x) { return x + x; }\n")  # another source: another library
    assert library(source, ["-O2", "-fPIC"], ["-shared"], "a test library").twice(4) == 8
    assert len(list(cache.glob("twice-*.so"))) == 2


def test_a_source_that_does_not_compile_gives_none_and_a_warning(tmp_path: Path, cache: Path,
                                                                   caplog: pytest.LogCaptureFixture):
    source = tmp_path / "broken.c"
    source.write_text("this is not C\n")
    with caplog.at_level(logging.WARNING, logger="engine.native.build"):
        assert library(source, ["-O2", "-fPIC"], ["-shared"], "a broken library") is None
    assert "building a broken library failed" in caplog.text
    assert not list(cache.glob("*")), "nothing half-built is left in the cache"


def test_a_missing_compiler_gives_none(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    source = tmp_path / "fine.c"
    source.write_text("int one(void) { return 1; }\n")
    assert library(source, ["-O2", "-fPIC"], ["-shared"], "a library") is None


def test_operators_that_do_not_compile_give_false_and_a_warning(tmp_path: Path, cache: Path,
                                                                caplog: pytest.LogCaptureFixture):
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++\n")
    with caplog.at_level(logging.WARNING, logger="engine.native.build"):
        assert operators(source, ["-O2"], "broken operators") is False
    assert "building broken operators failed" in caplog.text
    assert not list(cache.glob("*")), "nothing half-built is left in the cache"
