"""torch.compile of a model's decode and verify forwards, eager everywhere else and whenever it fails.

Per-forward overhead (Python, dispatch, one kernel per small op), not arithmetic, is what a small
step costs; inductor fuses the elementwise work of each layer and, with its C++ wrapper, calls the
kernels without Python, and on CPU a linear layer over a few rows becomes a loop of its own
(engine.small_linear) rather than an MKL call. Shapes are dynamic (the context length grows every
step, the batch and the draft count vary), so one graph serves every length; dynamo still
specialises on the layout's branches (one query or several, a contiguous cache span or a gather),
a handful of graphs, compiled at start-up by ``warm_up`` so that no request waits for them. Prefill
chunks stay eager: they are long, so their overhead is small beside their arithmetic.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine import attention, small_linear

logger = logging.getLogger(__name__)


class CompiledForward:
    def __init__(self, model: torch.nn.Module, name: str) -> None:
        self.model = model
        self.name = name
        # The C++ wrapper drops the Python between kernels; CUDA's wrapper is Python (graphs are the lever there).
        options: dict[str, Any] = {"cpp_wrapper": True} if next(model.parameters()).device.type == "cpu" else {}
        small_linear.install(model)  # few-row products as fused loops rather than MKL calls (CPU, float32)
        # dynamo counts recompilations per code object: one model's warm-up layouts pass the default limit of 8,
        # after which every new layout ran eagerly (with a warning) for the rest of the process.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        options["guard_filter_fn"] = _without_module_guards
        self.entry = _own_entry(name)
        compiled = torch.compile(self.entry, dynamic=True, options=options)
        self._compiled: Callable[..., Any] = lambda **inputs: compiled(model, inputs)
        self.failed = False
        self.frozen = False  # set after the start-up warm-up: a layout met later runs eagerly, uncompiled
        self.calls = 0  # forwards that ran compiled
        self.uncompiled = 0  # decode and verify forwards in a layout the warm-up did not compile, run eagerly

    @property
    def fn(self) -> Callable[..., Any]:
        """The compiled forward (the model's keyword inputs), for callers with their own fallback (engine.graphs
        captures it)."""
        return self._compiled

    def __call__(self, compiled: bool, **inputs: Any) -> Any:
        """``compiled``: the forward is a decode or verify step (short queries only)."""
        if compiled and not self.failed:
            try:
                if self.frozen:
                    # Compiling a new layout while serving would stall its request for seconds to a minute (and
                    # a batched workload meets dozens): those run eagerly, the warmed-up ones compiled. dynamo
                    # falls back silently; the attention layers' eager-call count tells it happened.
                    before = attention.eager_calls()
                    with torch.compiler.set_stance("eager_on_recompile"):
                        out = self._compiled(**inputs)
                    if attention.eager_calls() != before:
                        if not self.uncompiled:
                            logger.info("%s met a layout its warm-up did not compile; such forwards run eagerly "
                                        "(counted in CompiledForward.uncompiled)", self.name)
                        self.uncompiled += 1
                        return out
                else:
                    # No duck sizing: dynamo gives every input dimension of equal size one symbol, so a batch of
                    # two sequences traced beside a cache of two KV heads made the batch size a constant 2, and
                    # every other batch size ran eagerly.
                    with torch.fx.experimental._config.patch(use_duck_shape=False):
                        out = self._compiled(**inputs)
                self.calls += 1
                return out
            except Exception:
                self._fail()
        return self.model(**inputs)

    def _fail(self) -> None:
        """A model or layout inductor cannot handle: serve it eagerly from now on."""
        logger.exception("compiled forward of %s failed; running it eagerly from now on", self.name)
        self.failed = True


def _without_module_guards(entries: Sequence[Any]) -> list[bool]:
    """Which of a new graph's guards dynamo keeps: none on the model's modules (attributes, parameters, hooks),
    since this entry only ever runs its one model and nothing changes a module after loading, except what a
    hook reaches through its bound object: the runner's rows to keep, set per forward, which a graph depends on
    (dropping that guard gave a draft forward every row's logits instead of its kept rows')."""
    return [not e.orig_guard.source.is_unspecialized_nn_module() or "__self__" in e.name for e in entries]


def _own_entry(name: str) -> Callable[[torch.nn.Module, dict[str, Any]], Any]:
    """``model(**inputs)`` as a function with a code object of its own. dynamo keeps its graphs per code object
    and, at each call, tries them newest first, evaluating each one's guards until one passes. Compiling the
    model itself put the target's and the draft's graphs on their architecture's one ``forward``: a forward
    first failed the guards of every graph of the other model and of its own later layouts (the target's
    batch-1 decode, compiled first, was tried last). With an entry of its own per model and no module
    guards, side by side in one process (medians of 4 alternated rounds, two runs): the draft's batch-1
    decode forward 0.43 -> 0.36 and 0.53 -> 0.49 ms, the target's 3.33 -> 3.05 and 4.20 -> 3.47 ms."""
    ns: dict[str, Any] = {}
    exec(compile("def forward(model, inputs):\n    return model(**inputs)\n", f"<specd forward of {name}>", "exec"), ns)
    return ns["forward"]


def warm_up(forwards: list[Callable[[], object]], name: str) -> float:
    """Run each warm-up forward once (each compiles a graph the first time), logging progress; seconds taken."""
    t0 = time.perf_counter()
    for i, forward in enumerate(forwards, 1):
        t = time.perf_counter()
        forward()
        logger.info("compiling %s: layout %d/%d in %.1fs", name, i, len(forwards), time.perf_counter() - t)
    return time.perf_counter() - t0
