"""The GPU kit at toy size on the CPU: every stage runs and the JSON a GPU host would write comes out whole."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_kit_dry_run_runs_every_stage_and_writes_the_results_json(tmp_path):
    out = tmp_path / "gpu.json"
    run = subprocess.run([str(ROOT / "benchmarks/gpu/run.sh"), "--dry-run", "--out", str(out), "--logs",
                          str(tmp_path / "logs")], capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["dry_run"] is True and {"torch", "transformers", "commit", "device"} <= result["versions"].keys()
    stages = result["stages"]
    assert list(stages) == ["env", "lossless", "http", "step", "plan"]
    lossless = stages["lossless"]
    assert lossless["status"] == "ok" and lossless["passed"] == lossless["tests"] >= 1, lossless
    assert lossless["failures"] == lossless["errors"] == 0 and lossless["near_ties_excused"] >= 0
    rows = stages["http"]["rows"]
    assert [r["concurrency"] for r in rows] == [1, 2], rows
    for r in rows:
        assert r["default_tok_s"] > 0 and r["none_tok_s"] > 0 and r["default_vs_none"] > 0
        done, compared = map(int, r["same_text"].split("/"))
        assert compared > 0 and done == compared, r  # greedy in float32: identical to no speculation
    graphs = stages["step"]["graphs"]
    assert graphs["status"] == "ok" and graphs["decode_ms"] > 0 and graphs["over_floor"] > 0
    assert stages["plan"]["status"] == "ok" and any("memory plan" in line for line in stages["plan"]["plan"])
    assert "| code_newline | 1 |" in run.stdout  # the README's rows, printed


def test_a_second_command_on_the_same_commit_adds_its_stages_to_the_first_ones(tmp_path):
    out = tmp_path / "gpu.json"
    for stage in ("plan", "env"):
        subprocess.run([str(ROOT / "benchmarks/gpu/run.sh"), "--dry-run", "--stages", stage, "--out", str(out),
                        "--logs", str(tmp_path / "logs")], check=True, capture_output=True, timeout=200)
    assert set(json.loads(out.read_text())["stages"]) == {"env", "plan"}
