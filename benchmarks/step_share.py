"""Where a decode step's time goes on the embedded pair, eager against compiled: the target's forwards,
the drafting, and everything else (the engine's own host work), from the engine's own step timings.

    python benchmarks/step_share.py [--pair models/default] [--batches 1 8] [--prompts 8] [--max-tokens 96]

For each mode (eager, `compile=True`) and batch size, the hybrid default (draft model + n-gram lookup,
adaptive k) generates greedily from held-out prompts, `batch` at a time; over the steps that fed no
prompt token it sums StepStats' step, target and draft seconds. "engine share" = 1 - (target + draft) /
step: the part of a step that is neither model's forwards (scheduling, sampling, verification,
bookkeeping). Issue 14's goal: at most 10% with compilation on. Compiling first warms up (minutes cold).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from engine_bench.steps import recorded_steps
from transformers import AutoTokenizer

from engine import LLM, SamplingParams
from recipe.evaluate import held_out_prompts

REPO_ROOT = Path(__file__).resolve().parents[1]


def measure(llm: LLM, prompts: list[list[int]], batch: int, max_tokens: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    t0 = time.perf_counter()
    with recorded_steps(llm) as steps:
        for i in range(0, len(prompts), batch):
            llm.generate(prompts[i : i + batch], params)
    wall = time.perf_counter() - t0
    decode = [s for s in steps if s.num_prompt_tokens == 0]
    step_s = sum(s.step_seconds for s in decode)
    target_s, draft_s = sum(s.target_seconds for s in decode), sum(s.draft_seconds for s in decode)
    tokens = sum(s.num_generated_tokens for s in steps)
    return {"steps": len(decode), "step_ms": 1e3 * step_s / len(decode), "target_ms": 1e3 * target_s / len(decode),
            "draft_ms": 1e3 * draft_s / len(decode), "share": 1 - (target_s + draft_s) / step_s,
            "tok_s": tokens / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=REPO_ROOT / "models" / "default")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.pair / "target")
    prompts = held_out_prompts(tok, args.prompts)
    print("| mode | batch | decode steps | step ms | target ms | draft ms | engine share | tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for compiled in (False, True):
        t0 = time.perf_counter()
        llm = LLM(str(args.pair / "target"), draft_model=str(args.pair / "draft"), dtype="float32", device="cpu",
                  compile=compiled)
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0))  # first-call paths
        ready = time.perf_counter() - t0
        for batch in args.batches:
            r = measure(llm, prompts, batch, args.max_tokens)
            mode = f"compiled (ready in {ready:.0f} s)" if compiled else "eager"
            print(f"| {mode} | {batch} | {r['steps']} | {r['step_ms']:.2f} | {r['target_ms']:.2f} | "
                  f"{r['draft_ms']:.2f} | {100 * r['share']:.1f}% | {r['tok_s']:.1f} |", flush=True)
        del llm


if __name__ == "__main__":
    main()
