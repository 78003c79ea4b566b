"""Two servers starting on one host compile a graph file once: the second waits for the first's compile, then finds
its files current (engine.worker.compile_lock)."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
import types

import pytest

from engine.worker import compile_lock, precompile
from engine.worker.compile_lock import SUFFIX, one_at_a_time

HOLD = """
import fcntl, sys, time
from pathlib import Path
lock = open(sys.argv[1], "a")
fcntl.flock(lock, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(1.0)
Path(sys.argv[2]).write_bytes(b"graphs")
"""


def test_nothing_to_compile_takes_no_lock(tmp_path):
    done = tmp_path / "graphs.bin"
    done.write_bytes(b"graphs")
    with one_at_a_time([done], lambda f: not f.exists()):
        pass
    assert list(tmp_path.iterdir()) == [done], "no lock file"


def test_a_compile_waits_for_another_process_compiling_into_the_same_directory(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=compile_lock.__name__)
    graphs = tmp_path / "graphs.bin"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / f"graphs.bin{SUFFIX}"), str(graphs)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    t0 = time.perf_counter()
    with one_at_a_time([graphs], lambda f: not f.exists()):
        waited = time.perf_counter() - t0
        assert graphs.read_bytes() == b"graphs", "what the holder wrote is there once the lock is ours"
    holder.wait(timeout=30)
    assert waited > 0.5 and "another process is compiling graphs.bin; waiting for it" in caplog.text
    other = tmp_path / "other-model.bin"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / f"graphs.bin{SUFFIX}"), str(other)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    t0 = time.perf_counter()
    with one_at_a_time([tmp_path / "third-model.bin"], lambda f: not f.exists()):
        assert time.perf_counter() - t0 < 0.5, "another model's compile does not wait"
    holder.wait(timeout=30)


@pytest.mark.parametrize("graphs", ["decode", "prompt"])
def test_two_servers_asking_for_the_same_graphs_at_once_start_one_compile(graphs, tmp_path, monkeypatch):
    """The decode graphs of a background compile (or --compile start), and the prompt graphs after them."""
    files = {"target": tmp_path / "target.bin", "draft": tmp_path / "draft.bin"}
    monkeypatch.setattr(precompile, "prompt_artifact", lambda r, k: files[r.name])
    monkeypatch.setattr(precompile, "artifact", lambda r, k: files[r.name] if graphs == "decode" else tmp_path / "x")
    monkeypatch.setattr(precompile, "install", lambda runners, paths, k_max: True)
    monkeypatch.setattr(precompile, "_changed", lambda f: "" if f.exists() else "missing")
    children: list[list[str]] = []

    def spawn(models, k_max, block_size):  # noqa: ANN001, ANN202
        children.append([m.file for m in models])
        time.sleep(0.5)  # long enough for the other server to arrive while this compile runs
        for m in models:
            precompile.Path(m.file).write_bytes(b"graphs")
        return None

    monkeypatch.setattr(precompile, "spawn", spawn)
    monkeypatch.setattr(precompile, "_wait", lambda child: "")
    runners = [types.SimpleNamespace(name=n, cache=types.SimpleNamespace(block_size=16)) for n in files]
    results: list[list] = []
    if graphs == "decode":
        def serve() -> None:
            results.append(list(files.values()) if precompile.background(runners, 8, "float32", False)() else [])
    else:
        def serve() -> None:
            results.append(precompile.compile_prompts(runners, 8, "float32", False))
    servers = [threading.Thread(target=serve) for _ in range(2)]
    for server in servers:
        server.start()
    for server in servers:
        server.join(timeout=30)
    assert children == [[str(files["target"]), str(files["draft"])]], "one compile, of both files"
    assert results == [list(files.values())] * 2 and all(f.read_bytes() == b"graphs" for f in files.values())
