"""A rank other than 0: ``python -m engine.parallel`` (started by rank 0), or ``specd serve`` under torchrun
(server/cli.py hands ranks above 0 to ``follow_rank``). It loads its shard of whatever target rank 0 loads and runs
the forwards rank 0 runs, until rank 0 stops it (exit 0) or is lost (exit 1)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from engine.parallel.group import Ranks, device_type, join
from engine.parallel.mirror import follow
from engine.types.config import EngineConfig
from engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def load_shard(config: EngineConfig, ranks: Ranks) -> ModelRunner:
    """This rank's shard of the target, on this rank's device (every rank runs this at once: its probe forward is
    a collective)."""
    return ModelRunner.load(config.model, config.dtype, str(ranks.device), config.trust_remote_code,
                            tensor_parallel=ranks.size)


def follow_rank(device: str) -> int:
    """Join the ranks and follow rank 0; the exit code."""
    ranks = join(device_type(device))
    # torchrun passes a SIGTERM to every rank at once: rank 0 drains its requests, which need this rank's forwards,
    # and then stops it. So this rank ends when rank 0 says, or when rank 0 is gone.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    logger.info("tensor-parallel rank %d of %d on %s: following rank 0", ranks.rank, ranks.size, ranks.device)
    try:
        forwards = follow(ranks, lambda config: load_shard(config, ranks))
    except Exception as exc:  # gloo and NCCL raise RuntimeError subclasses when a peer's connection closes
        logger.critical("tensor-parallel rank %d lost rank 0 (%s: %s): exiting", ranks.rank, type(exc).__name__, exc)
        return 1
    logger.info("tensor-parallel rank %d: stopped by rank 0 after %d forwards", ranks.rank, forwards)
    return 0


def _exit_with(parent: int) -> None:
    """Rank 0 started this process: once it is gone (this process handed to another parent), so is this one,
    whatever this rank was waiting on. (PR_SET_PDEATHSIG would fire when the thread that started it ends.)"""
    while os.getppid() == parent:
        time.sleep(1.0)
    logger.critical("tensor-parallel rank %s: rank 0 (process %d) is gone: exiting", os.environ.get("RANK"), parent)
    logging.shutdown()
    os._exit(1)


def main() -> int:
    logging.basicConfig(level=os.environ.get("SPECD_LOG_LEVEL", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if parent := os.environ.get("SPECD_TP_PARENT"):
        threading.Thread(target=_exit_with, args=(int(parent),), daemon=True, name="rank-0-watch").start()
    return follow_rank(os.environ.get("SPECD_TP_DEVICE", "auto"))
