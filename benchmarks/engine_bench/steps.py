"""The engine's own step stats, recorded while an offline LLM generates."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from engine import LLM, StepStats


@contextmanager
def recorded_steps(llm: LLM) -> Iterator[list[StepStats]]:
    """Every step's StepStats while the block runs, in order."""
    steps: list[StepStats] = []
    inner = llm.engine.step

    def step():  # noqa: ANN202
        out = inner()
        if llm.engine.last_step is not None:
            steps.append(llm.engine.last_step)
        return out

    llm.engine.step = step  # an instance attribute: generate() calls engine.step
    try:
        yield steps
    finally:
        del llm.engine.step
