"""benchmarks/bench_serving.py runs against a live server and reports what it measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_bench_serving_smoke_run_reports_throughput_latency_and_acceptance(server, tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_serving

    out = tmp_path / "r.json"
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text('{"prompt": "def fib(n):"}\n{"prompt": "class Point:", "max_tokens": 8}\n')
    argv = ["bench_serving.py", "--base-url", server.url, "--num-prompts", "6", "--max-tokens", "12", "--ignore-eos",
            "--request-rate", "50", "--dataset", str(dataset), "--tokenizer", str(server.engine.config.model),
            "--json-out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    bench_serving.main()
    summary = json.loads(out.read_text())
    assert summary["completed"] == 6 and summary["failed"] == 0 and summary["model"] == "tiny-llama"
    assert summary["usage_completion_tokens"] == 3 * 12 + 3 * 8
    assert summary["output_tokens_counted_by"] == "tokenizer" and summary["total_output_tokens"] > 0
    assert summary["acceptance_source"] == "usage" and 0 <= summary["acceptance_rate"] <= 1
    assert summary["p50_ttft_ms"] > 0 and summary["p99_itl_ms"] >= summary["p50_itl_ms"]
    assert "Output token throughput" in capsys.readouterr().out
