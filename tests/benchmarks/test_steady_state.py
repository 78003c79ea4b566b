"""benchmarks/steady_state.py: the requests it feeds the engine, as the server would build them; no model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_an_extraction_request_runs_under_its_response_format_schema_and_a_plain_prompt_without_one():
    from transformers import AutoTokenizer

    from benchmarks.peer_bench.extraction import SCHEMA
    from benchmarks.peer_bench.prompts import PROMPT_SETS
    from benchmarks.steady_state import PARAMS, params_of
    from engine import Constraint

    tok = AutoTokenizer.from_pretrained(ROOT / "models" / "default" / "target")
    request = PROMPT_SETS["extraction"](tok, 2)[0]
    params = params_of(request)
    # Non-strict, as the server reads a json_schema response_format that leaves strict unset.
    assert params.constraint == Constraint.json_schema(SCHEMA, "response_format.json_schema.schema", strict=False)
    assert dataclasses.replace(params, constraint=None) == PARAMS
    assert params_of(PROMPT_SETS["quoting"](tok, 1)[0]) is PARAMS
