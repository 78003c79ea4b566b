#!/usr/bin/env python
"""Prefix caching on the embedded pair: TTFT and throughput with the cache on and off, side by side.

    python benchmarks/prefix_cache.py                # ~6 min on 2 cores
    python benchmarks/prefix_cache.py --rounds 1     # a quick look

Two engines (hybrid speculation, the server's default; one with --no-prefix-caching) load the same
weights in this process; rounds alternate between them, so machine noise hits both alike, and
every ratio is a median of per-round ratios. Prompts are token ids cut from held-out code (files
the pair never saw). Three workloads:

  few-shot     a shared 384-token prefix plus a different 16-token tail per request, one request
               at a time (the pair's context is 512), 32 new tokens each. The prefix is computed
               once per round before timing (warm); TTFT is arrival to the first token.
  chat replay  a five-turn conversation: each turn's prompt is the previous prompt, the model's
               answer (48 tokens) and 40 new tokens; TTFT of turns 2-5 (turn 1 has nothing cached).
  no reuse     three groups of 8 concurrent requests of 96-token prompts that share no block
               (fresh text every round), 64 new tokens each: throughput, the cost of hashing and
               registering blocks that are never reused.

The TTFT bound is the prompt's length over what is left to compute once the cache holds every full
block before the last token (the step that samples must compute at least one token). Writes
benchmarks/results/prefix_cache.json and docs/prefix_cache.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402
from peer_bench.prompts import _snippets  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.core.llm_engine import LLMEngine  # noqa: E402

PAIR = ROOT / "models" / "default"
PREFIX, TAIL, FEW_SHOT_NEW = 384, 16, 32
TURNS, TURN_NEW, ANSWER = 5, 40, 48
NO_REUSE_N, NO_REUSE_GROUPS, NO_REUSE_PROMPT, NO_REUSE_NEW = 8, 3, 96, 64


@dataclass(frozen=True)
class Run:
    ttft: list[float]  # seconds, per timed request
    tokens: int
    seconds: float
    hits: int  # prompt tokens the prefix cache supplied
    queries: int


def drive(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, one_at_a_time: bool) -> tuple[Run, list]:
    """Run prompts (one at a time, or all at once); TTFT is add_request to the step that emits a token."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ttft, outs, hits, queries = [], [], 0, 0
    t_start = time.perf_counter()
    groups = [[p] for p in prompts] if one_at_a_time else [prompts]
    for group in groups:
        arrival, first, got = time.perf_counter(), {}, {}
        for i, p in enumerate(group):
            engine.add_request(str(i), p, params)
            got[str(i)] = []
        while engine.has_unfinished():
            for o in engine.step():
                if o.new_token_ids and o.request_id not in first:
                    first[o.request_id] = time.perf_counter() - arrival
                got[o.request_id].extend(o.new_token_ids)
            if engine.last_step is not None:
                hits += engine.last_step.prefix_cache_hits
                queries += engine.last_step.prefix_cache_queries
        ttft.extend(first[str(i)] for i in range(len(group)))
        outs.extend(got[str(i)] for i in range(len(group)))
    seconds = time.perf_counter() - t_start
    return Run(ttft, sum(len(o) for o in outs), seconds, hits, queries), outs


def few_shot(engine: LLMEngine, text: list[int], r: int) -> Run:
    prefix = text[:PREFIX]
    tails = [text[PREFIX + TAIL * (r * 6 + i) : PREFIX + TAIL * (r * 6 + i + 1)] for i in range(6)]
    drive(engine, [prefix + tails[0]], 1, True)  # warms the cache (the engine without one: nothing)
    run, _ = drive(engine, [prefix + t for t in tails[1:]], FEW_SHOT_NEW, True)
    return run


def chat(engine: LLMEngine, text: list[int], r: int, rounds: int) -> Run:
    offset = PREFIX + TAIL * 6 * rounds + r * TURNS * TURN_NEW  # past the few-shot text: nothing shared with it
    prompt, ttft, hits, queries, tokens, seconds = [], [], 0, 0, 0, 0.0
    for turn in range(TURNS):
        prompt = prompt + text[offset + turn * TURN_NEW : offset + (turn + 1) * TURN_NEW]
        run, outs = drive(engine, [prompt], ANSWER, True)
        prompt = prompt + outs[0]
        if turn:
            ttft += run.ttft
            hits, queries = hits + run.hits, queries + run.queries
        tokens, seconds = tokens + run.tokens, seconds + run.seconds
    return Run(ttft, tokens, seconds, hits, queries)


def no_reuse(engine: LLMEngine, snippets: list[list[int]], r: int) -> Run:
    per_round = NO_REUSE_N * NO_REUSE_GROUPS
    ttft, tokens, seconds, hits, queries = [], 0, 0.0, 0, 0
    for g in range(NO_REUSE_GROUPS):
        start = r * per_round + g * NO_REUSE_N
        run, _ = drive(engine, [s[:NO_REUSE_PROMPT] for s in snippets[start : start + NO_REUSE_N]], NO_REUSE_NEW, False)
        ttft, tokens, seconds = ttft + run.ttft, tokens + run.tokens, seconds + run.seconds
        hits, queries = hits + run.hits, queries + run.queries
    return Run(ttft, tokens, seconds, hits, queries)


def distinct_snippets(tok: object, n: int, avoid: list[int]) -> list[list[int]]:
    """n prompts of NO_REUSE_PROMPT tokens, no two with the same first block and none starting like
    ``avoid`` (the other workloads' text: the held-out files are cut from the same starting points)."""
    out, seen = [], {tuple(avoid[i : i + 16]) for i in range(len(avoid) - 15)}
    for s in _snippets(tok, 2 * n, NO_REUSE_PROMPT):
        ids = tok.encode(s)[:NO_REUSE_PROMPT]  # type: ignore[attr-defined]
        if tuple(ids[:16]) not in seen:
            seen.add(tuple(ids[:16]))
            out.append(ids)
    if len(out) < n:
        raise SystemExit(f"only {len(out)} distinct held-out snippets, need {n}")
    return out[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pair", type=Path, default=PAIR)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "prefix_cache.json")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "prefix_cache.png")
    args = ap.parse_args()
    torch.manual_seed(0)
    engines = {
        on: LLM(model=str(args.pair / "target"), draft_model=str(args.pair / "draft"), dtype="float32",
                device="cpu", prefix_caching=on).engine
        for on in (True, False)
    }
    tok = engines[True].tokenizer
    print("cutting held-out text ...", flush=True)
    # One long stretch for the few-shot and chat workloads (each round takes fresh tails and turns),
    # and distinct snippets for the workload without reuse.
    long_text = [t for s in _snippets(tok, 12, 220) for t in tok.encode(s + "\n")]
    snippets = distinct_snippets(tok, NO_REUSE_N * NO_REUSE_GROUPS * (args.rounds + 1), long_text)
    need = PREFIX + TAIL * 6 * args.rounds + TURNS * TURN_NEW * args.rounds
    if len(long_text) < need:
        raise SystemExit(f"held-out text too short: {len(long_text)} tokens, need {need}")
    # One untimed pass of each workload per engine: the first forwards of a process are slow.
    for engine in engines.values():
        no_reuse(engine, snippets, args.rounds)
    workloads = {
        "few-shot": lambda e, r: few_shot(e, long_text, r),
        "chat replay": lambda e, r: chat(e, long_text, r, args.rounds),
        "no reuse": lambda e, r: no_reuse(e, snippets, r),
    }
    runs: dict[str, dict[bool, list[Run]]] = {w: {True: [], False: []} for w in workloads}
    for r in range(args.rounds):
        for name, work in workloads.items():
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                runs[name][on].append(work(engines[on], r))
                last = runs[name][on][-1]
                print(f"round {r + 1}/{args.rounds} {name:12s} cache {'on ' if on else 'off'}: "
                      f"TTFT p50 {statistics.median(last.ttft) * 1e3:7.1f} ms, "
                      f"{last.tokens / last.seconds:6.1f} tok/s, {last.hits}/{last.queries} prompt tokens cached",
                      flush=True)
    report(runs, args)


def report(runs: dict[str, dict[bool, list[Run]]], args: argparse.Namespace) -> None:
    bounds = {"few-shot": (PREFIX + TAIL) / (PREFIX + TAIL - 16 * ((PREFIX + TAIL - 1) // 16)), "chat replay": None,
              "no reuse": None}
    rows, table = [], []
    head = (f"{'workload':12s} | {'TTFT on':>9s} | {'TTFT off':>9s} | {'off/on':>6s} | {'bound':>5s} | "
            f"{'tok/s on':>8s} | {'tok/s off':>9s} | {'on/off':>6s} | {'hit rate':>8s}")
    table += [head, "-" * len(head)]
    for name, by in runs.items():
        on, off = by[True], by[False]
        ttft_ratio = statistics.median(statistics.median(b.ttft) / statistics.median(a.ttft) for a, b in zip(on, off))
        tput_ratio = statistics.median((a.tokens / a.seconds) / (b.tokens / b.seconds) for a, b in zip(on, off))
        hit_rate = sum(a.hits for a in on) / max(1, sum(a.queries for a in on))
        row = {
            "workload": name,
            "ttft_ms_on": statistics.median(t for a in on for t in a.ttft) * 1e3,
            "ttft_ms_off": statistics.median(t for b in off for t in b.ttft) * 1e3,
            "ttft_off_over_on": ttft_ratio,
            "ttft_bound": bounds[name],
            "tokens_per_s_on": statistics.median(a.tokens / a.seconds for a in on),
            "tokens_per_s_off": statistics.median(b.tokens / b.seconds for b in off),
            "throughput_on_over_off": tput_ratio,
            "hit_rate_on": hit_rate,
            "hit_rate_off": sum(b.hits for b in off) / max(1, sum(b.queries for b in off)),
        }
        rows.append(row)
        bound = f"{row['ttft_bound']:5.1f}" if row["ttft_bound"] else "    -"
        table.append(
            f"{name:12s} | {row['ttft_ms_on']:7.1f}ms | {row['ttft_ms_off']:7.1f}ms | {ttft_ratio:5.2f}x | {bound} | "
            f"{row['tokens_per_s_on']:8.1f} | {row['tokens_per_s_off']:9.1f} | {tput_ratio:5.2f}x | {hit_rate:7.1%}"
        )
    print("\n" + "\n".join(table))
    meta = {"rounds": args.rounds, "cpu_threads": torch.get_num_threads(), "machine": platform.platform(),
            "command": "python benchmarks/prefix_cache.py" + (f" --rounds {args.rounds}" if args.rounds != 5 else "")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")
    plot(rows, args.plot)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = [r["workload"] for r in rows]
    x = range(len(rows))
    a.bar([i - 0.2 for i in x], [r["ttft_ms_off"] for r in rows], 0.4, label="cache off")
    a.bar([i + 0.2 for i in x], [r["ttft_ms_on"] for r in rows], 0.4, label="cache on")
    a.set_xticks(list(x), names)
    a.set_ylabel("TTFT p50 (ms)")
    a.legend()
    b.bar(list(x), [r["throughput_on_over_off"] for r in rows])
    b.axhline(1.0, color="k", lw=0.8)
    b.set_xticks(list(x), names)
    b.set_ylabel("throughput, cache on / off")
    fig.suptitle("Prefix caching on the embedded pair (hybrid speculation, CPU)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
