#!/usr/bin/env python
"""The engine alone under a steady stream: where a speculating step's time goes, by kind of step.

    python benchmarks/steady_state.py [--set code_newline] [--concurrency 32] [--requests 96] [--rounds 3]
                                      [--compile start|off] [--prefill-hold-steps 4]

Two engines in one process, the default (hybrid, adaptive k) and no speculation, on the embedded pair, greedy,
128 new tokens. Each keeps --concurrency requests in flight: a request that ends is replaced by the next prompt
at once, as a loaded server sees them (a fixed LLM.generate batch instead drains to its slowest sequence;
cost_breakdown.py measures that case). Rounds interleave the engines, each round on prompts not sent before.
--prefill-hold-steps sets both engines' (0: every prompt admitted at once).
Extraction's requests run under their JSON schema, as the server reads their response_format; agentic's
conversations need compare.py.
Per engine and kind of step (decode only or with a prompt chunk; the goodput controller's plain, probe or
speculate): steps, milliseconds a step, of them the target's forward, the drafting (the drafters' forwards and
proposals) and the rest (planning, lookups, verification, the scheduler), tokens emitted and sequences decoding a
step. Then the step-cost model's own check: for every decode and verify forward the default timed after its first
third of steps, the target's seconds the model predicted (just before it learnt from that forward) over the
seconds measured, by tokens fed. No HTTP: compare.py's
servers add their own work, and the gap between the two is the server's.
Writes benchmarks/results/steady_state.json.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from transformers import AutoTokenizer  # noqa: E402

from benchmarks.peer_bench.prompts import PROMPT_SETS  # noqa: E402
from benchmarks.peer_bench.workload import Request  # noqa: E402
from engine import LLM, EngineConfig, LLMEngine, SamplingParams, StepStats  # noqa: E402
from server.protocol import ResponseFormat  # noqa: E402
from server.structured import from_response_format  # noqa: E402

PARAMS = SamplingParams(max_tokens=128, temperature=0.0)


def params_of(item: str | Request) -> SamplingParams:
    """PARAMS, with a Request's response_format (extraction's JSON schema) as its constraint, by the server's
    own reading of it."""
    fmt = item.extra.get("response_format") if isinstance(item, Request) else None
    if fmt is None:
        return PARAMS
    return dataclasses.replace(PARAMS, constraint=from_response_format(ResponseFormat.model_validate(fmt)))


def stream(llm: LLM, prompts: list[str | Request], concurrency: int) -> tuple[float, list[tuple[StepStats, int]]]:
    """Runs ``prompts`` with ``concurrency`` in flight; (wall seconds, every step's stats with the forwards it ran
    eagerly, the target's and the draft's)."""
    engine, pending, live, steps = llm.engine, iter(prompts), 0, []

    def admit() -> None:
        nonlocal live
        item = next(pending, None)
        if item is not None:
            params, prompt = params_of(item), item.prompt if isinstance(item, Request) else item
            engine.add_prepared(f"steady-{time.perf_counter_ns()}", engine.prepare(prompt, params), params)
            live += 1

    for _ in range(concurrency):
        admit()
    t0 = time.perf_counter()
    while live:
        eager = eager_forwards(engine)
        for out in engine.step():
            if out.finished:
                live -= 1
                admit()
        if engine.last_step is not None:
            steps.append((engine.last_step, eager_forwards(engine) - eager))
    return time.perf_counter() - t0, steps


def eager_forwards(engine: LLMEngine) -> int:
    """The forwards so far, the target's and the draft's, that no compiled graph served."""
    counts = engine.forward_counts
    return counts.uncompiled + counts.prompt_eager


def kind(s: StepStats) -> str:
    return ("mixed" if s.num_prompt_tokens else "decode") + (f" {s.speculation}" if s.speculation else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=REPO_ROOT / "models" / "default")
    ap.add_argument("--set", default="code_newline", choices=list(PROMPT_SETS))
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=96, help="requests a round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile", choices=("off", "start"), default="start")
    ap.add_argument("--prefill-hold-steps", type=int, default=EngineConfig.prefill_hold_steps,
                    help="both engines' (the server's --prefill-hold-steps)")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "steady_state.json")
    args = ap.parse_args()
    target, draft = str(args.pair / "target"), str(args.pair / "draft")
    tok = AutoTokenizer.from_pretrained(target)
    prompts = PROMPT_SETS[args.set](tok, args.requests * args.rounds)
    if any(not isinstance(p, str | Request) for p in prompts):  # agentic's turns: compare.py runs them
        raise SystemExit(f"--set {args.set}: its requests are conversations")
    hold = args.prefill_hold_steps
    llms = {"default": LLM(target, draft_model=draft, compile=args.compile, prefill_hold_steps=hold),
            "none": LLM(target, speculative_method="none", compile=args.compile, prefill_hold_steps=hold)}
    # The step-cost model's prediction for each forward it is shown, taken before it learns from it.
    cost = llms["default"].engine.drafting.controller.cost.target
    checks: list[tuple[float, float, float]] = []
    learn = cost.observe

    def observe(tokens: float, context: float, seconds: float, verify: bool = False) -> None:
        checks.append((tokens, cost(tokens, context, verify), seconds))
        learn(tokens, context, seconds, verify)

    cost.observe = observe
    tok_s: dict[str, list[float]] = collections.defaultdict(list)
    kinds: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    for r in range(args.rounds):
        batch = prompts[r * args.requests : (r + 1) * args.requests]
        for name in (list(llms) if r % 2 == 0 else list(reversed(llms))):
            wall, steps = stream(llms[name], batch, args.concurrency)
            tok_s[name].append(sum(s.num_generated_tokens for s, _ in steps) / wall)
            for s, eager in steps:
                k = kinds[(name, kind(s))]
                k["eager"] += eager
                k["steps"] += 1
                k["ms"] += 1e3 * s.step_seconds
                k["target_ms"] += 1e3 * s.target_seconds
                k["draft_ms"] += 1e3 * s.draft_seconds
                k["tokens"] += s.num_generated_tokens
                k["decoding"] += s.num_decoding
                k["prompt_tokens"] += s.num_prompt_tokens
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {v[-1]:.0f} tok/s" for n, v in tok_s.items()),
              flush=True)
    medians = {n: statistics.median(v) for n, v in tok_s.items()}
    print(f"\ndefault / none: {medians['default'] / medians['none']:.2f}x (ratio of median tok/s, "
          f"{args.concurrency} in flight, {args.set})\n")
    print("| engine | step | steps | ms a step | target ms | draft ms | rest ms | tokens a step | decoding "
          "| prompt tokens | eager forwards |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for (name, k), c in sorted(kinds.items()):
        n = c["steps"]
        row = {"engine": name, "step": k, "steps": n, "ms": c["ms"] / n, "target_ms": c["target_ms"] / n,
               "draft_ms": c["draft_ms"] / n, "rest_ms": (c["ms"] - c["target_ms"] - c["draft_ms"]) / n,
               "tokens": c["tokens"] / n, "decoding": c["decoding"] / n, "prompt_tokens": c["prompt_tokens"] / n,
               "eager_forwards": c["eager"]}
        rows.append(row)
        print(f"| {name} | {k} | {n} | {row['ms']:.2f} | {row['target_ms']:.2f} | {row['draft_ms']:.2f} | "
              f"{row['rest_ms']:.2f} | {row['tokens']:.1f} | {row['decoding']:.1f} | {row['prompt_tokens']:.0f} | "
              f"{c['eager']} |")
    by_size: dict[int, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for tokens, predicted, seconds in checks[len(checks) // 3 :]:  # once the model has followed the compile
        b = by_size[int(tokens) // 16 * 16]
        b[0] += 1
        b[1] += predicted
        b[2] += seconds
    print("\n| tokens fed | forwards | predicted / measured |\n|---|---|---|")
    model = []
    for size, (n, predicted, seconds) in sorted(by_size.items()):
        model.append({"tokens_from": size, "forwards": n, "predicted_over_measured": predicted / seconds})
        print(f"| {size}-{size + 15} | {n} | {predicted / seconds:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": " ".join(sys.argv), "machine": platform.processor() or platform.machine(), "set": args.set,
        "concurrency": args.concurrency, "compile": args.compile, "prefill_hold_steps": hold, "tok_s": tok_s,
        "default_over_none": medians["default"] / medians["none"], "steps": rows, "step_cost_check": model,
    }, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
