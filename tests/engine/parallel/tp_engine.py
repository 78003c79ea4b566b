"""Rank 0 of a tensor-parallel engine, run as ``python -m tests.engine.parallel.tp_engine SPEC OUT``: it starts the
other ranks itself (engine.parallel.launch), as ``specd serve`` does, builds one engine per case of the JSON spec in
turn (the ranks load each case's target), and writes each case's outputs and what every rank holds. A process of
its own: joining ranks sets the process's thread count and process group, which the test process must keep."""

from __future__ import annotations

import json
import sys

from engine import LLM, SamplingParams


def run_case(case: dict) -> dict:
    llm = LLM(case["model"], tensor_parallel_size=case["ranks"], **case["engine"])
    greedy = SamplingParams(max_tokens=case["max_new"], temperature=0.0)
    out = {"greedy": [o.token_ids for o in llm.generate(case["prompts"], greedy)]}
    sampled = [SamplingParams(max_tokens=case["max_new"], temperature=case["temperature"], top_p=case["top_p"],
                              seed=seed) for seed in case["seeds"]]
    out["sampled"] = [o.token_ids for o in llm.generate(case["prompts"], sampled)]
    out["draft_tokens"] = llm.stats().num_draft_tokens
    target = llm.engine.target
    out["facts"] = target.leader.facts(target)
    return out


def main(spec_path: str, out_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    results = {case["label"]: run_case(case) for case in spec["cases"]}
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
