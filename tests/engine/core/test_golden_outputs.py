"""The embedded pair's greedy outputs, for every drafting method, match a golden file written by the engine
before engine/ moved into subpackages: a move or a cleanup changes no token.

Rewrite the file only when a change is meant to change outputs (a retrained pair):
    python -m tests.engine.core.test_golden_outputs
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import LLM, SamplingParams

GOLDEN = Path(__file__).with_name("golden_greedy.json")
PAIR = Path(__file__).resolve().parents[3] / "models" / "default"
PROMPTS = [
    "def fibonacci(n):\n    ",
    "import numpy as np\n\n\ndef normalize(x):\n    \"\"\"Scale x to unit norm.\"\"\"\n",
    "The history of the city begins",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\nfor i in range(",
]
MAX_TOKENS = 40
K = 4  # fixed: an adaptive k follows measured step times, and a golden file must not

METHODS: dict[str, dict] = {
    "none": dict(speculative_method="none"),
    "draft_model": dict(speculative_method="draft_model", draft_model=str(PAIR / "draft")),
    "ngram": dict(speculative_method="ngram"),
    "hybrid": dict(speculative_method="hybrid", draft_model=str(PAIR / "draft")),
    "self": dict(speculative_method="self"),
    "eagle": dict(speculative_method="eagle", draft_model=str(PAIR / "eagle")),
}


def generate(method: str) -> list[list[int]]:
    llm = LLM(str(PAIR / "target"), num_speculative_tokens=K, compile="off", **METHODS[method])
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return [out.token_ids for out in outs]


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_outputs_match_the_golden_file(method: str) -> None:
    golden = json.loads(GOLDEN.read_text())
    assert golden["prompts"] == PROMPTS and golden["max_tokens"] == MAX_TOKENS
    assert generate(method) == golden["outputs"][method]


if __name__ == "__main__":
    GOLDEN.write_text(
        json.dumps(
            {"prompts": PROMPTS, "max_tokens": MAX_TOKENS, "outputs": {m: generate(m) for m in METHODS}}, indent=1
        )
        + "\n"
    )
    print(f"wrote {GOLDEN}")
