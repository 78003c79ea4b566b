"""Where speculation's time goes, by concurrency: the default (hybrid, adaptive k) against no speculation on
the embedded pair, per decode step: the target's forward (verification), the drafting, the rest of the step,
tokens emitted per sequence-step, and what that makes of tokens per second.

    python benchmarks/cost_breakdown.py [--compile off|start] [--sets code code_newline random]
                                        [--concurrency 1 8 32 64] [--rounds 3] [--max-tokens 64]

Each concurrency c runs c prompts of a set as one batch (LLM.generate), greedy, both engines alive in one
process and interleaved round by round, so machine noise hits both alike; every round sends prompts not
sent before, to engines made fresh for each set. Per (set, c, engine): medians over
rounds of the decode steps' mean step / target / draft milliseconds (StepStats, steps that fed no prompt
token), tokens emitted per sequence-step, and tokens/s over the whole generate() call; "vs none" is the
ratio of the two engines' median tokens/s. The speculative step pays off only when tokens per sequence-step
grow faster than its step time over the plain one: the table puts both beside each other. A fixed batch runs
as long as its slowest sequence (sequences that finish early leave the later steps smaller), so tokens/s here
gains less from speculation than the mean tokens per sequence-step suggests; the server under continuous
arrivals (compare.py's never-lose matrix) refills those slots.
Writes benchmarks/results/cost_breakdown_<compile>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from transformers import AutoTokenizer  # noqa: E402

from benchmarks.engine_bench.steps import recorded_steps  # noqa: E402
from benchmarks.peer_bench.loops import is_loop  # noqa: E402
from benchmarks.peer_bench.prompts import PROMPT_SETS  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

ENGINES = {"default": dict(speculative_method="hybrid"), "none": dict(speculative_method="none")}


def run(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[dict[str, float], list[list[int]]]:
    t0 = time.perf_counter()
    with recorded_steps(llm) as steps:
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    wall = time.perf_counter() - t0
    decode = [s for s in steps if s.num_prompt_tokens == 0 and s.num_decoding]
    n = max(1, len(decode))
    seq_steps = sum(s.num_decoding for s in decode)
    row = {
        "decode_steps": len(decode),
        "step_ms": 1e3 * sum(s.step_seconds for s in decode) / n,
        "target_ms": 1e3 * sum(s.target_seconds for s in decode) / n,
        "draft_ms": 1e3 * sum(s.draft_seconds for s in decode) / n,
        "tokens_per_seq_step": sum(s.num_generated_tokens for s in decode) / max(1, seq_steps),
        "mean_k": sum(s.mean_k * s.num_decoding for s in decode) / max(1, seq_steps),
        "tok_s": sum(len(o.token_ids) for o in outs) / wall,
        # a looping tiny model flatters every lookup drafter: the share of outputs that are repetition loops
        "loop_share": sum(is_loop(o.token_ids) for o in outs) / len(outs),
    }
    row["other_ms"] = row["step_ms"] - row["target_ms"] - row["draft_ms"]
    return row, [o.token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=REPO_ROOT / "models" / "default")
    ap.add_argument("--compile", choices=("off", "start"), default="off")
    # generate() takes text: agentic conversations (each turn built from the last output) and extraction's
    # response_format run through the server, in compare.py.
    ap.add_argument("--sets", nargs="+", default=["code", "code_newline", "random"],
                    choices=[name for name in PROMPT_SETS if name not in ("agentic", "extraction")])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    out = args.out or REPO_ROOT / "benchmarks" / "results" / f"cost_breakdown_{args.compile}.json"
    tok = AutoTokenizer.from_pretrained(args.pair / "target")
    rows, ready = [], {}
    print("| set | conc | engine | step ms | target ms | draft ms | other ms | tokens/seq-step | mean k | tok/s "
          "| loops | vs none | same |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.sets:
        # Fresh engines per set and a prompt never sent twice: suffix decoding's index over earlier outputs
        # would otherwise draft a repeated prompt's whole output (a repeat is the agentic workload's case,
        # not these sets').
        t0 = time.perf_counter()
        llms = {
            e: LLM(str(args.pair / "target"), draft_model=str(args.pair / "draft"), compile=args.compile, **kw)
            for e, kw in ENGINES.items()
        }
        ready[name] = time.perf_counter() - t0
        pool = iter(PROMPT_SETS[name](tok, 2 + sum(args.concurrency) * args.rounds))
        warm = [next(pool), next(pool)]
        for llm in llms.values():  # first-call paths, outside the rounds
            llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0))
        for c in args.concurrency:
            rounds: dict[str, list[dict[str, float]]] = {e: [] for e in llms}
            same = True
            for r in range(args.rounds):
                prompts = [next(pool) for _ in range(c)]
                texts = {}
                for e in (list(llms) if r % 2 == 0 else list(reversed(llms))):
                    row, texts[e] = run(llms[e], prompts, args.max_tokens)
                    rounds[e].append(row)
                same = same and texts["default"] == texts["none"]
            med = {e: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for e, rs in rounds.items()}
            for e, m in med.items():
                ratio = m["tok_s"] / med["none"]["tok_s"]
                rows.append({"set": name, "concurrency": c, "engine": e, **m, "vs_none": ratio,
                             "same_as_none": same, "rounds": rounds[e]})
                print(f"| {name} | {c} | {e} | {m['step_ms']:.1f} | {m['target_ms']:.1f} | {m['draft_ms']:.1f} | "
                      f"{m['other_ms']:.1f} | {m['tokens_per_seq_step']:.2f} | {m['mean_k']:.2f} | "
                      f"{m['tok_s']:.0f} | {100 * m['loop_share']:.0f}% | {ratio:.2f}x | {'yes' if same else 'NO'} |",
                      flush=True)
        del llms
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": " ".join(sys.argv), "machine": platform.processor() or platform.machine(),
        "compile": args.compile, "ready_seconds": ready, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "statistic": "medians over interleaved rounds; vs_none = ratio of median tokens/s",
        "rows": rows,
    }, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
