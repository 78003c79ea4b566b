"""Starting the ranks: under torchrun every rank is already a process (rank 0 serves, the others follow);
otherwise rank 0, the server's own process, starts the others as ``python -m engine.parallel``."""

from __future__ import annotations

import atexit
import logging
import os
import socket
import subprocess
import sys
import threading

from engine.parallel.group import join
from engine.parallel.mirror import Leader

logger = logging.getLogger(__name__)

_RANKS: list[Leader] = []  # one set of ranks per process: a process group is joined once


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def start(size: int, kind: str) -> Leader:
    """Rank 0's side of ``size`` ranks on devices of ``kind`` (cpu or cuda), started on first use; a later engine
    in the same process reuses them."""
    if _RANKS:
        if _RANKS[0].ranks.size != size:
            raise ValueError(f"this process already leads {_RANKS[0].ranks.size} tensor-parallel ranks, not {size}")
        return _RANKS[0]
    workers: list[tuple[int, subprocess.Popen]] = []
    if under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != size:
            raise ValueError(f"tensor_parallel_size is {size} but torchrun started {os.environ['WORLD_SIZE']} "
                             "processes: give --nproc-per-node the same number")
        if int(os.environ["RANK"]) != 0:
            raise RuntimeError("only rank 0 loads an engine; the other ranks follow it (engine.parallel.worker)")
    else:
        port = _free_port()
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        workers = [_spawn(rank, size, kind, port) for rank in range(1, size)]
    # Watched from the start: a rank that dies before joining would otherwise leave this one waiting in the join.
    for rank, proc in workers:
        threading.Thread(target=_watch, args=(rank, proc, workers), daemon=True, name=f"tp-rank-{rank}").start()
    logger.info("tensor parallel: joining %d ranks on %s", size, kind)
    leader = Leader(join(kind))
    _RANKS.append(leader)
    atexit.register(_stop, leader)
    return leader


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(rank: int, size: int, kind: str, port: int) -> tuple[int, subprocess.Popen]:
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), SPECD_TP_DEVICE=kind, SPECD_TP_PARENT=str(os.getpid()))
    # A session of its own: a terminal's Ctrl-C or a process-group signal meant for the server reaches rank 0,
    # which drains and then stops this rank, instead of killing this rank mid-drain.
    proc = subprocess.Popen([sys.executable, "-m", "engine.parallel"], env=env, start_new_session=True)
    return rank, proc


def _watch(rank: int, proc: subprocess.Popen, workers: list[tuple[int, subprocess.Popen]]) -> None:
    """A rank that exits before rank 0 stopped it takes the server down: without it no forward can run."""
    code = proc.wait()
    if _RANKS and _RANKS[0].stopped:
        return
    logger.critical("tensor-parallel rank %d exited with code %d; the target cannot run without it: exiting "
                    "(restart the server)", rank, code)
    for _, other in workers:
        if other.poll() is None:
            other.kill()
    logging.shutdown()
    os._exit(1)


def _stop(leader: Leader) -> None:
    try:
        leader.stop()
    except Exception as exc:  # at exit, with a rank already gone: nothing is left to tell
        logger.warning("tensor parallel: could not stop the other ranks cleanly: %s", exc)
