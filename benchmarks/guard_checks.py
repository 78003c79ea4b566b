"""What a precompiled graph's guard check costs per forward: every guard, or only those not on the model (the
model's checked once at load), both through torch's check, which binds the inputs to the entry's signature
(``inspect``); and the latter handed the inputs as they come, as the server checks them (engine.worker.model_guards).

    python benchmarks/guard_checks.py [--conversations 4] [--serve-args "..."] [--json PATH]

The default server's engine, its graph files loaded (shipped, or written by an earlier start), serves batch-1
agentic turns, greedy, 128 tokens (--serve-args '--speculative-method draft_model --num-speculative-tokens 8':
the draft model drafts every step; by default the goodput controller leaves it idle on these turns). Each graph
holds both guard managers, and the arm a check takes turns call by call, so machine noise and the cache state
a forward leaves behind hit all three alike. Reported per model: the median time of a guard check that passed (the
graph then ran), and the median forward beside it. Whole turns per second are left to compare.py: on a shared
2-core machine their rounds swing by more than this saves.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from peer_bench.agentic import agentic_prompts  # noqa: E402
from torch._dynamo.package import load_guard_manager, load_guards_state  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.worker.aot_graphs import _as_compiled  # noqa: E402
from engine.worker.compile_cache import machine  # noqa: E402
from server.cli import parse_config  # noqa: E402

ARMS = ("every guard", "not the model's", "and unbound")
MIN_CHECKS = 50  # per arm, for a median worth printing


def instrument(runner: Any, times: dict[str, list[float]], turn: itertools.count) -> int:
    """Gives each of ``runner``'s graphs its full guard manager beside the split one it loaded with, and times
    each check, the arm taking turns call by call. Returns the number of graphs."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    graphs = [fn for group in runner.compiled.precompiled.graphs.values() for fn in group]
    with _as_compiled(runner.compiled.precompiled.rows, None):  # building guards reads the per-thread flags
        for fn in graphs:
            state = load_guards_state(fn._artifacts.guards_state)
            split = fn._artifacts.guard_manager
            managers = (load_guard_manager(state, fn._artifacts.original_code, fn.fn.__globals__), split, split)
            direct = fn.guard_check  # engine.worker.model_guards.check_directly's, where the server gave it
            bound = functools.partial(AOTCompiledFunction.guard_check, fn)
            checks = (bound, bound, direct)

            def check(*args: Any, _fn: Any = fn, _checks: tuple = checks, _managers: tuple = managers,
                      **kwargs: Any) -> bool:
                arm = next(turn) % len(ARMS)
                _fn._artifacts.guard_manager = _managers[arm]
                t0 = time.perf_counter()
                ok = _checks[arm](*args, **kwargs)
                if ok:
                    times[ARMS[arm]].append(time.perf_counter() - t0)
                return ok

            fn.guard_check = check
    forward = runner.forward

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = forward(*args, **kwargs)
        times["forward"].append(time.perf_counter() - t0)
        return out

    runner.forward = timed
    return len(graphs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--serve-args", default="", help="options of specd serve, e.g. '--speculative-method draft_model'")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "guard_checks.json")
    args = ap.parse_args()

    llm = LLM(parse_config(["serve", *shlex.split(args.serve_args)]).engine_config())
    engine = llm.engine
    runners = {"target": engine.target, **{f"draft ({d.name})": d.runner for d in engine.drafting.drafters
                                           if getattr(d, "runner", None) is not None}}
    missing = [name for name, r in runners.items() if r.compiled is None or r.compiled.precompiled is None]
    if missing:
        sys.exit(f"no graph files loaded for {', '.join(missing)}: start `make serve` once and let it compile")
    turn = itertools.count()
    times = {name: {arm: [] for arm in (*ARMS, "forward")} for name in runners}
    graphs = {name: instrument(r, times[name], turn) for name, r in runners.items()}

    greedy = SamplingParams(temperature=0.0, max_tokens=128)
    for conversation in agentic_prompts(engine.tokenizer, args.conversations):
        prompt = conversation.first
        for _ in range(conversation.turns):
            out = llm.generate([prompt], greedy)[0]
            prompt = prompt + out.text + conversation.follow_up

    rows = []
    print(f"| model | graphs | checks | {' (us) | '.join(ARMS)} (us) | split saves | unbound saves | forward (us) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, t in times.items():
        checks = sum(len(t[arm]) for arm in ARMS)
        if min(len(t[arm]) for arm in ARMS) < MIN_CHECKS:
            print(f"| {name} | {graphs[name]} | {checks} | too few to tell | | | | | |")
            continue
        full, split, unbound = (1e6 * statistics.median(t[arm]) for arm in ARMS)
        forward = 1e6 * statistics.median(t["forward"])
        rows.append({"model": name, "graphs": graphs[name], "checks": checks, "full_us": full, "split_us": split,
                     "unbound_us": unbound, "forward_us": forward})
        print(f"| {name} | {graphs[name]} | {checks} | {full:.0f} | {split:.0f} | {unbound:.0f} | "
              f"{(full - split) / forward:.1%} | {(split - unbound) / forward:.1%} | {forward:.0f} |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": {**machine(), "node": platform.node()},
                                     "serve_args": args.serve_args, "rows": rows},
                                    indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
