"""A precompiled graph's guards on its model checked once, when the graph is read back, instead of every forward.

Of the ~1,400 guards of a target graph of the embedded pair, ~1,200 read the model's module tree: its hooks
dicts, attributes, config constants, the type of every module, each parameter's sizes. A graph file is keyed by
the checkpoint and the code (engine.worker.graph_files.key), runs only the one model it was loaded for
(aot_graphs.Precompiled), and nothing changes a module after loading (the in-process compile drops these guards
outright: engine.worker.compiled), so checking them at load answers what checking them every forward would.
Those left, checked every forward, read the forward's inputs (sizes, attention metadata), the process's global
state, and what a hook reaches through its bound object (the runner's rows to keep, set per forward).

A graph whose model guards fail at load keeps all its guards, and fails them every forward, as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from collections.abc import Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)


def on_the_model(name: str) -> bool:
    """Whether a guard on the source ``name`` reads only the model's module tree (the compiled entry is
    ``L['self']``; ``__self__`` is a hook's bound object, the runner, whose per-forward state a graph depends on)."""
    return "L['self']" in name and "L['inputs']" not in name and "__self__" not in name


@dataclasses.dataclass
class Split:
    """What reading a file's graphs back did with their guards."""

    graphs: int = 0
    kept_whole: int = 0  # graphs whose model guards failed at load: every guard stays


def _with_guards(guards_state: Any, guards: list[Any]) -> Any:
    from torch._guards import GuardsSet
    from torch.utils._ordered_set import OrderedSet

    output_graph = dataclasses.replace(guards_state.output_graph, _guards=GuardsSet(OrderedSet(guards)))
    return dataclasses.replace(guards_state, output_graph=output_graph)


@contextlib.contextmanager
def checked_at_load(entry: torch.nn.Module) -> Iterator[Split]:
    """While graphs are read back (``AOTCompiledFunction.deserialize``) in this block, each one's guards on the
    model are checked once against ``entry`` (the module the graphs run, as the file traced it) and left out of
    those its forwards check. Without the hook this torch offers, graphs keep every guard (logged)."""
    from torch._dynamo import package

    split = Split()
    build = getattr(package, "load_guard_manager", None)
    if build is None:
        logger.info("this torch builds a graph's guards elsewhere: precompiled graphs check all their guards")
        yield split
        return

    def load_guard_manager(guards_state: Any, target_code: Any, runtime_global_scope: Any) -> Any:
        split.graphs += 1
        guards = list(guards_state.output_graph.guards)
        model = [g for g in guards if on_the_model(g.name)]
        once = build(_with_guards(guards_state, model), target_code, runtime_global_scope)
        if not once.check({"self": entry}):
            split.kept_whole += 1
            return build(guards_state, target_code, runtime_global_scope)
        rest = [g for g in guards if not on_the_model(g.name)]
        return build(_with_guards(guards_state, rest), target_code, runtime_global_scope)

    # AOTCompiledFunction builds its guards through this module's function, looked up at each call: swapping it
    # for the block is the one place between a file's bytes and a graph's guard manager open to us. Only reading
    # graphs back calls it (dynamo's own compiles build theirs directly), so a compile in another thread meanwhile
    # is untouched.
    package.load_guard_manager = load_guard_manager
    try:
        yield split
    finally:
        package.load_guard_manager = build


def check_directly(fn: Any) -> None:
    """Gives ``fn`` (a graph read back: dynamo's ``AOTCompiledFunction``) a guard check that hands its guards the
    entry and the inputs as they come, instead of binding them to the entry's signature (``inspect``) at every
    call: about a fifth of a batch-1 check's time, target and draft alike. Binding ``(self, **inputs)`` without
    defaults or a closure gives ``{"self": entry, "inputs": inputs}``; a graph of any other signature keeps
    torch's check."""
    artifacts = getattr(fn, "_artifacts", None)
    signature = getattr(artifacts, "signature", None)
    if signature is None or getattr(artifacts.runtime_env, "closure", None):
        return
    params = [(p.name, p.kind, p.default) for p in signature.parameters.values()]
    if params != [("self", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty),
                  ("inputs", inspect.Parameter.VAR_KEYWORD, inspect.Parameter.empty)]:
        return

    def guard_check(entry: torch.nn.Module, /, **inputs: Any) -> bool:
        return artifacts.guard_manager.check({"self": entry, "inputs": inputs})

    fn.guard_check = guard_check
