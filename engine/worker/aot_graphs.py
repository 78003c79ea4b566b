"""Graphs compiled ahead of time, one full graph per warm-up layout, written to bytes and read back in another
process without tracing (dynamo's ``aot_compile``); engine.worker.precompile runs them in a child process.

dynamo cannot serialise guards on object identities (None, functions, closures): they are dropped when
compiling. The code they pinned is checked line by line before a file is used (``stale``), and its modules are
the checkpoint's, which keys the file (engine.worker.precompile.key); None-ness is not, so each graph
keeps its layout's structure (which of the attention metadata's fields are None, the rows kept for the LM head or
not) and a forward runs only a graph of its own structure whose remaining guards (sizes, dtypes, constants)
pass, else eagerly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import pickle
import re
import time
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from engine.layers import attention
from engine.layers.tracing import compiled_call
from engine.worker.warm_up_layouts import warm_up_layouts

logger = logging.getLogger(__name__)

# Guards dynamo cannot write to a file (identities of objects of this process).
UNSERIALISABLE = ("ID_MATCH", "CLOSURE_MATCH", "WEAKREF_ALIVE", "DICT_VERSION")


class Entry(torch.nn.Module):
    """What is compiled: the model's forward on keyword inputs, as a module of a module-level class (the graphs'
    files name the code they replace, and a bound method of the model's own class is a wrapper there)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **inputs: Any) -> Any:
        return self.model(**inputs)


def structure(value: Any) -> Any:
    """What of ``value`` (the attention metadata) the dropped identity guards told apart: None or not, the kind and
    count of its parts, its bools; sizes and values the kept guards check."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(structure(v) for v in value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__,
                tuple(structure(getattr(value, f.name)) for f in dataclasses.fields(value) if f.compare))
    return type(value).__name__


@contextlib.contextmanager
def _as_compiled(rows: Any, keep: torch.Tensor | None) -> Iterator[None]:
    """The state a compiled forward of the runner runs in (engine.worker.compiled), with ``keep`` as its LM head's
    rows (``rows``: the runner's per-thread holder)."""
    rows.keep = keep
    try:
        with compiled_call(), torch.fx.experimental._config.patch(use_duck_shape=False), torch.inference_mode():
            yield
    finally:
        rows.keep = None


def _guards(entries: Sequence[Any]) -> list[bool]:
    """The guards a file can hold. Unlike the in-process compile (engine.worker.compiled), the ones on the model's
    modules stay: a file's guards are built again at load against the module tree they pickled, and one dropped
    there leaves the model out of it."""
    return [e.guard_type not in UNSERIALISABLE and not ({"ID_MATCH", "DICT_VERSION"} & set(e.derived_guard_types))
            for e in entries]


def compile_runner(runner: Any, k_max: int) -> bytes:
    """The runner's warm-up layouts (engine.worker.warm_up_layouts), each compiled to a full graph, serialised.
    The runner has its cache and its layers installed under its name (``small_linear.install``)."""
    from torch._dynamo.aot_compile import AOTCompiledFunction, ModelInput

    captured: list[tuple[dict[str, Any], torch.Tensor | None]] = []

    def grab(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        captured.append((dict(kwargs), getattr(runner._rows, "keep", None)))

    handle = runner.model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        # Past the first blocks, as the server's background warm-up writes past its block manager's: a span that
        # starts at slot 0 is traced as the constant 0 and every other start fails the guard.
        first = runner.cache.num_blocks // 3
        for batch in warm_up_layouts(k_max, runner.cache.block_size, runner.cache.num_blocks, first):
            runner.forward(batch)
    finally:
        handle.remove()
    options: dict[str, Any] = {"cpp_wrapper": True, "guard_filter_fn": _guards}
    compiled = torch.compile(Entry(runner.model), fullgraph=True, dynamic=True, options=options)
    t0 = time.perf_counter()
    done = []
    for i, (kwargs, keep) in enumerate(captured, 1):
        # dynamo restarts a trace that must turn a float into a tensor (TensorifyScalarRestartAnalysis) by
        # itself in torch.compile, not in aot_compile: the second try knows, so one retry.
        for attempt in (1, 2):
            try:
                # Every size and int the layout's metadata holds symbolic from the first trace (the cache's blocks,
                # where a span starts): dynamo keeps those it reaches through an object's attributes constant until
                # a second call differs, and an ahead-of-time compile makes one.
                dynamic = re.escape(f"L['inputs']['{attention.METADATA_KWARG}']")
                with torch._dynamo.config.patch(enable_aot_compile=True), \
                        torch.compiler.config.patch(dynamic_sources=dynamic):
                    compiled._aot_compile([ModelInput((), kwargs, [_as_compiled(runner._rows, keep)])])
                done.append((kwargs, keep, compiled.forward.compiled_results[0]))
                break
            except Exception as exc:
                if attempt == 2:
                    logger.warning("layout %d of %s did not compile (%r): it runs eagerly", i, runner.name, exc)
        logger.info("compiling %s ahead of time: layout %d/%d", runner.name, i, len(captured))
    logger.info("compiled %d layouts of %s in %.1fs", len(done), runner.name, time.perf_counter() - t0)
    graphs, sources = [], set()
    for kwargs, keep, fn in done:
        # Each graph's traced code, by module and lines, without the modules' whole text that dynamo keeps beside
        # it (95% of the file): stale() reads the lines again at load.
        info = fn._artifacts.source_info
        sources |= {(s.module, s.firstlineno, s.lastlineno, s.checksum) for s in info.inlined_sources}
        info.inlined_sources = set()
        # The globals its code reads that the file does not carry (modules dynamo named after this process's
        # objects): where the loading process imports them.
        env, scope = fn._artifacts.runtime_env, fn.fn.__globals__
        carried = {*env.import_sources, *env.used_globals, fn._artifacts.backend_id}
        refs = {ref: _importable(scope[ref], runner.name) for ref in env.external_refs - carried}
        blob = AOTCompiledFunction.serialize(fn).serialized_data
        graphs.append(((structure(kwargs[attention.METADATA_KWARG]), keep is not None), blob, refs))
    return pickle.dumps({"sources": sorted(sources), "graphs": graphs})


def stale(data: bytes) -> str:
    """What of the code the graphs in ``data`` traced differs in this process ("" where nothing does): a graph runs
    the code as it was when traced, so any change there makes it another forward than the eager one."""
    from torch._dynamo.package import _hash_sourcelines

    for module, first, last, checksum in pickle.loads(data)["sources"]:
        try:
            same = _hash_sourcelines(importlib.import_module(module), first, last) == checksum
        except (ImportError, OSError):
            same = False
        if not same:
            return f"{module}, lines {first}-{last}"
    return ""


def _importable(value: Any, name: str) -> tuple[str, str]:
    """Where another process finds ``value``, a global a graph of model ``name`` reads: (module, attribute)."""
    if isinstance(value, types.ModuleType):
        return value.__name__, ""
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if module and qualname and _imported(module, qualname) is value:
        return module, qualname
    raise TypeError(f"a graph of {name} reads {value!r}, which another process cannot import")


def _imported(module: str, qualname: str) -> Any:
    value = importlib.import_module(module)
    for part in qualname.split(".") if qualname else ():
        value = getattr(value, part)
    return value


class Precompiled:
    """A model's graphs loaded from a file: ``__call__`` runs the one its inputs fit, or returns None."""

    def __init__(self, runner: Any, data: bytes) -> None:
        from torch._dynamo.aot_compile import AOTCompiledFunction

        self.rows = runner._rows
        self.entry = Entry(runner.model)
        self.graphs: dict[Any, list[Any]] = {}
        # Building a graph's guards reads the values they guard, the per-thread flags among them.
        with _as_compiled(self.rows, None):
            for shape, blob, refs in pickle.loads(data)["graphs"]:
                scope = {ref: _imported(*where) for ref, where in refs.items()}
                self.graphs.setdefault(shape, []).append(AOTCompiledFunction.deserialize(blob, scope))

    def __len__(self) -> int:
        return sum(len(g) for g in self.graphs.values())

    def __call__(self, **inputs: Any) -> Any:
        keep = getattr(self.rows, "keep", None)
        for fn in self.graphs.get((structure(inputs[attention.METADATA_KWARG]), keep is not None), ()):
            with compiled_call():  # no config patch here: only a trace reads it, and it costs every forward
                if fn.guard_check(self.entry, **inputs):
                    return fn(self.entry, **inputs)
        return None
