from __future__ import annotations

from pathlib import Path

import pytest

from recipe.corpus import EXCLUDED_DIRS, is_held_out, split, stdlib_files, text_files


def test_stdlib_file_list_is_sorted_deterministic_and_excludes_tests_and_tables():
    files = stdlib_files()
    again = stdlib_files()
    assert [f.relpath for f in files] == [f.relpath for f in again] == sorted(f.relpath for f in files)
    assert len(files) > 100
    for f in files:
        assert f.relpath.endswith(".py")
        assert not set(Path(f.relpath).parts) & EXCLUDED_DIRS


def test_held_out_split_is_disjoint_nonempty_and_depends_only_on_the_path():
    train, held = split(stdlib_files())
    assert train and held
    assert not {f.relpath for f in train} & {f.relpath for f in held}
    assert 0.02 < len(held) / (len(train) + len(held)) < 0.10
    for f in held:
        assert is_held_out(f.relpath)
    # The same relative path under another root lands on the same side.
    assert is_held_out(held[0].relpath) and not is_held_out(train[0].relpath)


def test_user_corpus_walks_directories_and_names_a_missing_path(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("# b\n")
    (tmp_path / "sub" / "c.bin").write_bytes(b"\0\1")
    assert [Path(f.relpath).name for f in text_files([str(tmp_path)])] == ["a.py", "b.md"]
    with pytest.raises(FileNotFoundError, match="nope"):
        text_files([str(tmp_path / "nope")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no text files"):
        text_files([str(tmp_path / "empty")])
