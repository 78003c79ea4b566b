"""Where a model's graph files lie and what names them: what does not change with a clone (``key``), so that one
built from the same checkout anywhere, shipped in a compile cache among them, loads here (engine.worker.precompile)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
import transformers

from engine.worker.compile_cache import PRECOMPILED, cache_dir, engine_source, machine
from engine.worker.prompt_layouts import prompt_blocks, prompt_layouts

WEIGHTS = (".safetensors", ".bin", ".pt")
EDGE = 1 << 20  # bytes read from each end of a weights file


def fingerprint(model: str) -> list[Any]:
    """A checkpoint, the same in any clone or copy of it: its config, and each weights file's size and ends (the
    weights themselves are the graphs' inputs; they only tell two checkpoints of one config apart)."""
    model_dir = Path(model)
    if not model_dir.is_dir():
        return [model]
    facts: list[Any] = []
    for path in sorted(model_dir.iterdir()):
        if path.name == "config.json":
            facts.append((path.name, hashlib.sha256(path.read_bytes()).hexdigest()))
        elif path.suffix in WEIGHTS and path.is_file():
            size, digest = path.stat().st_size, hashlib.sha256()
            with path.open("rb") as f:
                digest.update(f.read(EDGE))
                f.seek(max(0, size - EDGE))
                digest.update(f.read(EDGE))
            facts.append((path.name, size, digest.hexdigest()))
    return facts


def key(runner: Any, k_max: int) -> str:
    """What a model's graphs depend on besides the code they traced: the libraries, the machine and its thread
    count, the checkpoint, the layers' ops. Stable across clones: a graph file built elsewhere from the same
    checkout loads here."""
    # The thread count too: every graph's guards check it (dynamo's global state), and a file built at another
    # count loaded and never ran (tests at one thread a worker met graphs a run at two had written).
    facts = {"engine": engine_source(), "torch": torch.__version__, "transformers": transformers.__version__,
             **machine(), "threads": torch.get_num_threads(), "model": fingerprint(runner.name),
             "dtype": str(runner.dtype).removeprefix("torch."),
             "k_max": k_max, "block_size": runner.cache.block_size}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:24]


def artifact(runner: Any, k_max: int) -> Path:
    return cache_dir() / PRECOMPILED / f"{key(runner, k_max)}.bin"


def prompt_artifact(runner: Any, k_max: int) -> Path:
    """The file of the runner's prompt graphs, beside its decode graphs' and keyed by the prompt layouts too: they
    change without making the decode graphs shipped for every kind of CPU stale."""
    bs = runner.cache.block_size
    # The layouts themselves, not their file's text: a comment changed there leaves the files current.
    shapes = [(b.starts, [len(t) for t in b.token_ids], b.logits_rows, b.block_tables)
              for b in prompt_layouts(k_max, bs, prompt_blocks(k_max, bs))]
    layouts = hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:12]
    return artifact(runner, k_max).with_name(f"{key(runner, k_max)}-prompts-{layouts}.bin")
