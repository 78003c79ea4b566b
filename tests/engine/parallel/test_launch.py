"""Starting the ranks never hangs: a rank that dies before it joins takes rank 0 down at once, with a line
naming it and exit 1 (rank 0 would otherwise wait in the join)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

DIES_AT_START = """
import subprocess, sys
import engine.parallel.launch as launch
launch._spawn = lambda rank, size, kind, port: (rank, subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"]))
from engine import LLM
LLM(sys.argv[1], tensor_parallel_size=2, device="cpu")
print("loaded without its second rank")
"""


def test_a_rank_that_dies_before_joining_takes_rank_0_down_with_exit_1(model_sets):
    proc = subprocess.run([sys.executable, "-c", DIES_AT_START, str(model_sets["llama"].target)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "tensor-parallel rank 1 exited with code 3" in proc.stderr
    assert "loaded without" not in proc.stdout
