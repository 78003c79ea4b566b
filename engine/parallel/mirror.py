"""Keeping the ranks in step: rank 0 tells the others, before it acts on the target, what it is about to do (load
it, allocate its cache, run a forward), and they do the same. The forward's own collectives (transformers'
all-reduces inside the sharded layers) then meet in the same order on every rank. Only the target is sharded:
drafting, verification and sampling happen on rank 0 alone, so nothing of theirs crosses."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from engine.parallel.group import Ranks
from engine.parallel.shares import local
from engine.types.config import EngineConfig
from engine.worker.forward_batch import ForwardBatch
from engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Leader:
    """Rank 0's side. Its target runner calls ``forward`` before each of its forwards (ModelRunner.leader)."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self.stopped = False
        self._lock = threading.Lock()  # one message at a time, whichever thread sends it

    def _say(self, *message: Any) -> None:
        with self._lock:
            if self.stopped:
                raise RuntimeError("the tensor-parallel ranks were stopped")
            dist.broadcast_object_list([message], src=0, group=self.ranks.control)

    def load(self, config: EngineConfig) -> None:
        self._say("load", config)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        self._say("allocate", num_blocks, block_size)

    def forward(self, batch: ForwardBatch) -> None:
        self._say("forward", portable(batch))

    def facts(self, runner: ModelRunner) -> list[dict[str, Any]]:
        """What each rank holds of the target (``shard_facts``), rank by rank."""
        self._say("facts")
        out: list[Any] = [None] * self.ranks.size
        dist.gather_object(shard_facts(runner, self.ranks.rank), out, dst=0, group=self.ranks.control)
        return out

    def stop(self) -> None:
        """The other ranks exit (0). Idempotent; at interpreter exit too (engine.parallel.launch)."""
        if not self.stopped:
            self._say("stop")
            self.stopped = True


def portable(batch: ForwardBatch) -> ForwardBatch:
    """The batch with its tokens as host lists: a draft loop's device tensor of tokens is rank 0's alone."""
    if batch.input_ids is None:
        return batch
    flat = iter(batch.input_ids.view(-1).tolist())
    tokens = [list(itertools.islice(flat, len(t))) for t in batch.token_ids]
    return ForwardBatch(tokens, batch.starts, batch.block_tables, batch.logits_rows)


def follow(ranks: Ranks, load: Callable[[EngineConfig], ModelRunner]) -> int:
    """A rank other than 0: do what rank 0 says until it says stop. Returns the forwards run."""
    runner: ModelRunner | None = None
    forwards = 0
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=ranks.control)
        kind, *args = box[0]
        if kind == "stop":
            return forwards
        if kind == "load":
            runner = None  # the previous target's weights and cache go before the next one's come
            runner = load(args[0])
            continue
        assert runner is not None, f"rank 0 said {kind!r} before any load"
        if kind == "allocate":
            runner.allocate_cache(*args)
        elif kind == "forward":
            runner.forward(args[0])
            forwards += 1
        elif kind == "facts":
            dist.gather_object(shard_facts(runner, ranks.rank), None, dst=0, group=ranks.control)
        else:
            raise RuntimeError(f"unknown message from rank 0: {kind!r}")


def shard_facts(runner: ModelRunner, rank: int) -> dict[str, Any]:
    """This rank's share of the target: elements of the sharded weights it holds against their full size, the
    replicated ones, and its cache's KV heads per layer."""
    sharded = [p for p in runner.model.parameters() if isinstance(p, DTensor)]
    assert runner.cache is not None
    return {
        "rank": rank,
        "sharded_local": sum(local(p).numel() for p in sharded),
        "sharded_full": sum(p.numel() for p in sharded),
        "replicated": sum(p.numel() for p in runner.model.parameters() if not isinstance(p, DTensor)),
        "kv_heads": [k.shape[1] for k in runner.cache.k],
    }
