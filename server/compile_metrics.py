"""The compile's series, read from the engine at each scrape: ``specd:compile_state`` and how many forwards of the
compiled models ran eagerly or on which graphs."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge

from engine import ForwardCounts
from server.read_counter import ReadCounter

COMPILE_STATES = ("off", "compiling", "compiled", "failed")  # LLMEngine.compile_state


def declare_compile(registry: CollectorRegistry, model_name: str, state: Callable[[], str],
                    counts: Callable[[], ForwardCounts]) -> None:
    """The state as 1 for the engine's, 0 for the others (the exposition of prometheus_client's Enum, whose value is
    set, not read when scraped), and the forward counters."""
    for name, doc, read in (
        ("specd:uncompiled_forwards", "Decode and verify forwards of a compiled model run eagerly: their layout "
         "was not among the compiled ones.", lambda: counts().uncompiled),
        ("specd:compiled_prompt_forwards", "Forwards of a compiled model with a prompt chunk that a loaded prompt "
         "graph served.", lambda: counts().prompt_compiled),
        # A prompt chunk runs compiled only where a precompiled file of prompt graphs was loaded (make
        # compile-cache and --compile start build them) and one of its layouts fits the step.
        ("specd:eager_prompt_forwards", "Forwards of a compiled model with a prompt chunk run eagerly: no prompt "
         "graph fits the step, or none was loaded.", lambda: counts().prompt_eager)):
        ReadCounter(name, doc, model_name, read, registry)
    family = Gauge("specd:compile_state", "torch.compile of the decode and verify forwards: off, compiling (served "
                   "eagerly until ready), compiled, or failed (served eagerly).", ["model_name", "state"],
                   registry=registry)
    for name in COMPILE_STATES:
        family.labels(model_name, name).set_function(lambda name=name: float(state() == name))
