"""The prompt graphs compiled once the decode graphs serve, where a background compile found none current.

The decode and verify graphs are what a background compile switches to; prompt chunks ran eagerly until a later
start found prompt graphs on disk, and only ``--compile start`` and ``make compile-cache`` built those. A host
whose compile cache ships decode graphs without prompt ones (the embedded pair's AVX2 graphs) never got them: there
the default server spent 10.2 s of 45.9 s in prompt steps serving agentic conversations at 8 concurrent, where
``--speculative-method none --compile`` spent 4.8 s (benchmarks/compare.py, 2 CPU cores). Here a thread compiles
them in a child at the lowest CPU priority (precompile.compile_prompts) and adds them to the graphs each model
serves, where its prompt chunks then find them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from engine.worker import precompile
from engine.worker.graph_files import artifact, prompt_artifact

logger = logging.getLogger(__name__)


class PromptCompile:
    """The prompt graphs of ``runners`` (the target first), compiled in a thread once started (``start``: once
    every runner serves its precompiled decode graphs, and the step-cost model has been profiled on them, so that
    the child's work does not skew it)."""

    def __init__(self, runners: Sequence[Any], k_max: int, dtype: str, trust_remote_code: bool) -> None:
        self.runners, self.k_max, self.dtype, self.trust_remote_code = list(runners), k_max, dtype, trust_remote_code
        self.thread = threading.Thread(target=self._run, name="specd-prompt-compile", daemon=True)
        self.added = 0  # prompt graphs added to the served ones
        self.seconds: float | None = None  # the whole of it, once done
        self._then: list[Callable[[], object]] = []

    @property
    def running(self) -> bool:
        return self.thread.is_alive()

    def start(self) -> None:
        if self.thread.ident is None:
            self.thread.start()

    def start_after(self, background: Any | None, between_steps: Callable[[Callable[[], object]], None]) -> None:
        """Started at once where there is no ``background`` compile (the decode graphs were on disk); else on the
        stepping thread once it is done, after the jobs it queued before (``between_steps``: the step-cost model's
        profile of the compiled forwards, timed before the child takes any of the cores)."""
        if background is None:
            self.start()
        else:
            background.then(lambda: between_steps(self.start))

    def then(self, job: Callable[[], object]) -> None:
        """Run ``job`` in the thread once prompt graphs were added (not where none were missing or the child failed)."""
        self._then.append(job)

    def missing(self) -> list[Any]:
        """The runners that serve precompiled decode graphs but have no current prompt graphs on disk (a runner
        whose prompt file was current had its graphs added when its decode graphs were installed)."""
        return [r for r in self.runners if r.compiled is not None and r.compiled.precompiled is not None
                and not precompile.current(prompt_artifact(r, self.k_max))]

    def _run(self) -> None:
        t0 = time.perf_counter()
        missing = self.missing()
        if not missing:
            return
        logger.info("compile: compiling the prompt graphs of %s in a child process; their prompt chunks run "
                    "eagerly until then", " and ".join(r.name for r in missing))
        try:
            # Every runner, the target first: only the missing files are compiled, and a runner's place marks a draft
            precompile.compile_prompts(self.runners, self.k_max, self.dtype, self.trust_remote_code)
        except RuntimeError as exc:
            logger.warning("%s; prompt chunks stay eager", exc)
            return
        for runner in missing:
            before = len(runner.compiled.precompiled)
            precompile.add_prompts(runner, runner.compiled.precompiled, artifact(runner, self.k_max).stem,
                                   prompt_artifact(runner, self.k_max))
            self.added += len(runner.compiled.precompiled) - before
        self.seconds = time.perf_counter() - t0
        logger.info("prompt graphs compiled and added in %.1fs: %d graphs", self.seconds, self.added)
        if self.added:
            for job in self._then:
                job()
