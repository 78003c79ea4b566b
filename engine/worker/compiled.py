"""torch.compile of a model's decode and verify forwards, eager everywhere else and whenever it fails.

Per-forward overhead (Python, dispatch, one kernel per small op), not arithmetic, is what a small
step costs; inductor fuses the elementwise work of each layer and, with its C++ wrapper, calls the
kernels without Python, and on CPU a linear layer over a few rows becomes a loop of its own
(engine.layers.small_linear) rather than an MKL call. Shapes are dynamic (the context length grows every
step, the batch and the draft count vary), so one graph serves every length; dynamo still
specialises on the layout's branches (one query or several, a contiguous cache span or a gather),
a handful of graphs, compiled by ``warm_up`` before any request runs them: at start-up, or while the engine
serves eagerly (``CompileMode.BACKGROUND``), the model switching to its compiled forwards once every graph is
built. In the background the graphs are compiled by a child process and loaded from its files
(engine.worker.precompile); in a thread of this process where that fails. Prefill chunks stay eager: they are
long, so their overhead is small beside their arithmetic.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.layers import attention, small_linear
from engine.layers.compile_limit import compile_with_limit
from engine.layers.tracing import compiled_call
from engine.types.config import CompileMode
from engine.worker.compile_cache import tag_caches

logger = logging.getLogger(__name__)

SWITCH_INTERVAL = 1e-4  # seconds: the GIL's switch interval while a background warm-up runs


def resolve_mode(mode: CompileMode, device: torch.device, dtype: torch.dtype, split: bool, eagle: bool) -> CompileMode:
    """What ``mode`` comes to for a target on ``device`` in ``dtype`` (``split``: across devices by a device map;
    ``eagle``: an EAGLE head reads its hidden states). AUTO: BACKGROUND where compiling measured faster at every
    batch size (float32 on CPU; docs/performance.md) and inductor finds its C++ compiler, else OFF. BACKGROUND
    becomes START on CUDA (the graphs capture the compiled forwards at start-up; the staging buffers rotate
    per process), for a split model, and with an EAGLE head (its hidden-state hooks are not per thread)."""
    if mode is CompileMode.AUTO:
        cxx = os.environ.get("CXX", "g++")  # what inductor looks for (torch._inductor.config.cpp.cxx)
        if split or device.type != "cpu" or dtype != torch.float32:
            logger.info("compile auto: off (measured to pay on CPU in float32; this is %s %s%s)", device.type,
                        str(dtype).removeprefix("torch."), ", split across devices" if split else "")
            return CompileMode.OFF
        if shutil.which(cxx) is None:
            logger.info("compile auto: off (no C++ compiler %r for inductor; install one, e.g. g++, to compile)", cxx)
            return CompileMode.OFF
        return CompileMode.BACKGROUND
    if mode is CompileMode.BACKGROUND and (device.type != "cpu" or split or eagle):
        why = ("CUDA graphs capture the compiled forwards" if device.type != "cpu" else
               "a model split across devices" if split else "an EAGLE head drafts")
        logger.info("compile background: compiled at start-up instead (%s)", why)
        return CompileMode.START
    return mode


class CompiledForward:
    def __init__(self, model: torch.nn.Module, name: str) -> None:
        self.model = model
        self.name = name
        # The C++ wrapper drops the Python between kernels; CUDA's wrapper is Python (graphs are the lever there).
        options: dict[str, Any] = {"cpp_wrapper": True} if next(model.parameters()).device.type == "cpu" else {}
        tag_caches()
        small_linear.install(model)  # few-row products as fused loops rather than MKL calls (CPU, float32)
        options["guard_filter_fn"] = _without_module_guards
        self.entry = _own_entry(name)
        # dynamo counts recompilations per code object: one model's warm-up layouts pass the default limit of 8,
        # after which every new layout ran eagerly (with a warning) for the rest of the process. Given here, not
        # in torch._dynamo.config where this torch allows (compile_limit says why).
        # One graph per layout or none: with the module guards gone, the frames dynamo resumes after a graph break
        # reused graphs across layouts and gave wrong logits (a tiny llama with a break in its first layer: 0.12-0.21
        # off at 4 sequences x 5 tokens after 1 x 2). A model with a break fails here and runs eagerly (_fail).
        compiled = compile_with_limit(self.entry, 64, dynamic=True, fullgraph=True, options=options)

        # Once frozen: the graphs compiled so far and never a new one, for this thread alone.
        # set_stance("eager_on_recompile") did that for the whole process: while one thread served, another's
        # warm-up ran eagerly, and two threads' overlapping stances could leave it set for good (a later model
        # then never compiled).
        run_only = torch._dynamo.run(self.entry)

        def call(**inputs: Any) -> Any:
            with compiled_call():
                return compiled(model, inputs)

        def serve(**inputs: Any) -> Any:
            with compiled_call():
                return run_only(model, inputs)

        self._compiled: Callable[..., Any] = call
        self._serve: Callable[..., Any] = serve
        self.failed = False
        self.frozen = False  # set after the warm-up: a layout met later runs eagerly, uncompiled
        # While a background warm-up is due or running, its thread: only that thread's forwards compile. Any other
        # thread's run eagerly: reaching the compiled function they would trace layouts of their own, a request
        # waiting out the compile, two threads tracing at once.
        self.warming_in: threading.Thread | None = None
        self.calls = 0  # forwards that ran compiled
        self.uncompiled = 0  # decode and verify forwards in a layout the warm-up did not compile, run eagerly
        self.prompt_compiled = 0  # forwards with a prompt chunk that a loaded prompt graph served
        self.prompt_eager = 0  # forwards with a prompt chunk run eagerly
        # Graphs compiled in a child process and loaded from its file (engine.worker.precompile): they serve
        # instead of this process's own torch.compile once set.
        self.precompiled: Callable[..., Any] | None = None

    @property
    def state(self) -> str:
        """compiling (a background warm-up is due or running), compiled, or failed (running eagerly)."""
        if self.failed:
            return "failed"
        return "compiled" if self.frozen and self.warming_in is None else "compiling"

    @property
    def fn(self) -> Callable[..., Any]:
        """The compiled forward (the model's keyword inputs), for callers with their own fallback (engine.worker.graphs
        captures it)."""
        return self._compiled

    def __call__(self, compiled: bool, prompt: bool = False, apart: bool = False, **inputs: Any) -> Any:
        """``compiled``: the forward is a decode or verify step, or a prompt chunk (``prompt``) its loaded graphs
        may fit (engine.worker.prompt_layouts: one that none fits runs eagerly, not counted in ``uncompiled``, or
        returns None where the caller can run it ``apart``)."""
        if compiled and not self.failed and self.warming_in in (None, threading.current_thread()):
            try:
                if self.precompiled is not None:
                    out = self.precompiled(**inputs)
                    if out is not None:
                        self.calls += 1
                        self.prompt_compiled += prompt
                        return out
                    if prompt:
                        self.prompt_eager += not apart
                        return None if apart else self.model(**inputs)
                    if not self.uncompiled:
                        logger.info("%s met a layout its precompiled graphs do not fit; such forwards run eagerly "
                                    "(counted in CompiledForward.uncompiled)", self.name)
                    self.uncompiled += 1
                    return self.model(**inputs)
                if self.frozen:
                    # Compiling a new layout while serving would stall its request for seconds to a minute (and
                    # a batched workload meets dozens): those run eagerly, the warmed-up ones compiled. dynamo
                    # falls back silently; the attention layers' eager-call count tells it happened.
                    before = attention.eager_calls()
                    out = self._serve(**inputs)
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
        self.prompt_eager += prompt
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


# nn.Module's own, as this module was imported: no compile was running then (see shield_from_tracing).
_MODULE_CALL, _MODULE_GETATTR = torch.nn.Module.__call__, torch.nn.Module.__getattr__


def shield_from_tracing(model: torch.nn.Module) -> None:
    """Let ``model``'s eager forwards run while another thread compiles. AOTAutograd's tracer (fx) replaces
    ``nn.Module.__call__`` and ``__getattr__`` for the whole process while it traces, so every module call in
    every thread went through that tracer, its module stack and all: a draft forward in the serving thread
    failed there ("module is not installed as a submodule") while the target's graph was traced. The model's
    module classes get nn.Module's own two functions as attributes of their own, which the patch of the base
    class does not reach; they are the same functions, so nothing changes for any module of those classes,
    nor for dynamo, which tells a plain module call by that very function."""
    for cls in {type(m) for m in model.modules()}:
        for name, fn in (("__call__", _MODULE_CALL), ("__getattr__", _MODULE_GETATTR)):
            if name not in cls.__dict__:
                setattr(cls, name, fn)


class BackgroundWarmUp:
    """Runs warm-ups one after another in a daemon thread while the caller serves; from construction until every
    warm-up is done, the models' decode and verify forwards run eagerly in every other thread."""

    def __init__(self, jobs: list[tuple[CompiledForward, Callable[[], object]]],
                 precompiled: Callable[[], bool] | None = None) -> None:
        """``precompiled``: tried first, in the thread; True when it gave every model its graphs
        (engine.worker.precompile), which skips the jobs."""
        self.jobs = jobs
        self.precompiled = precompiled
        self.thread = threading.Thread(target=self._run, name="specd-compile", daemon=True)
        for compiled, _ in jobs:
            shield_from_tracing(compiled.model)
            compiled.warming_in = self.thread
        self.seconds: float | None = None  # all of it, once done
        self._then: list[Callable[[], object]] = []

    def then(self, job: Callable[[], object]) -> None:
        """Run ``job`` in the thread once every model serves compiled (before ``start``)."""
        self._then.append(job)

    def start(self) -> BackgroundWarmUp:
        self.thread.start()
        return self

    def join(self, timeout: float | None = None) -> bool:
        """Whether every warm-up is done."""
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def _run(self) -> None:
        try:
            # Below the serving thread in the CPU scheduler's eyes (Linux: a thread's own nice value; the compile
            # workers it starts inherit it): on a machine of few cores the requests come first.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        # Tracing is Python that holds the GIL, and an eager forward lets go of it at every torch op: with the
        # default switch interval of 5 ms each op then waited up to 5 ms to get it back. Measured on the embedded
        # pair (2 cores, warm caches): batch-1 requests during the compile got 32 tok/s on average (one took 53 s
        # for 64 tokens) at 5 ms, 84 tok/s at 0.1 ms (200 eager with no compile running); the compile took 150 s
        # instead of 87.
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, SWITCH_INTERVAL))
        t0 = time.perf_counter()
        done = False
        if self.precompiled is not None:
            try:
                done = self.precompiled()
            except Exception:
                logger.exception("compiling in a child process failed; compiling here instead")
        for compiled, job in [] if done else self.jobs:
            try:
                job()
            except Exception:
                logger.exception("warming up the compiled forwards of %s failed; they run eagerly", compiled.name)
                compiled.failed = True
            compiled.frozen = True
        for compiled, _ in self.jobs if done else []:
            compiled.frozen = True
        # Every model switches at once, when no warm-up is left: a step then runs all its forwards one way.
        for compiled, _ in self.jobs:
            compiled.warming_in = None
        self.seconds = time.perf_counter() - t0
        logger.info("background compile done in %.1fs: %s", self.seconds,
                    ", ".join(f"{c.name} {c.state}" for c, _ in self.jobs))
        for job in self._then:
            try:
                job()
            except Exception:
                logger.exception("after the background compile, %r failed", job)
        sys.setswitchinterval(interval)
