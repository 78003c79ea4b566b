"""``python -m server serve`` with faults injected from the environment, for the process-level tests:
SPECD_TEST_STEP_SLEEP (seconds added to every engine step), SPECD_TEST_CRASH_AFTER (steps before
the engine raises)."""

from __future__ import annotations

import os
import sys
import time

from engine import LLMEngine
from server.cli import main

SLEEP = float(os.environ.get("SPECD_TEST_STEP_SLEEP", "0"))
CRASH_AFTER = int(os.environ.get("SPECD_TEST_CRASH_AFTER", "0"))


def install_faults() -> None:
    original = LLMEngine.step
    count = [0]

    def step(self: LLMEngine) -> list:
        count[0] += 1
        if CRASH_AFTER and count[0] > CRASH_AFTER:
            raise RuntimeError("injected engine crash")
        time.sleep(SLEEP)
        return original(self)

    LLMEngine.step = step  # type: ignore[method-assign]


if __name__ == "__main__":
    install_faults()
    sys.exit(main(sys.argv[1:]))
