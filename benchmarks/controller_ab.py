#!/usr/bin/env python
"""A goodput-controller setting against the default and against no speculation, in one process.

    python benchmarks/controller_ab.py --set agentic --concurrency 1 --per-round 4 --rounds 6 \
        --controller probe_interval=16 [--engine max_lookup_tokens=8]

Three engines on the embedded pair, all compiled before the first round: the default (hybrid, adaptive k), the
default with its controller's attributes set by --controller NAME=VALUE (any of GoodputController's: a
probe_interval, a probe_budget, a margin...) and its engine's options by --engine NAME=VALUE (an integer
EngineConfig field), and --speculative-method none. Each keeps --concurrency requests in
flight (a request that ends is replaced at once; an agentic conversation sends its next turn, built from the
output, when a turn ends), greedy, 128 new tokens, each round on prompts not sent before, the engines' order
turned every round. Prints each round's ratios over none and the ratio of median tokens/s; checks that the three
produced the same tokens. No HTTP: it isolates the controller's choices from the server's own work
(compare.py measures the servers). Writes benchmarks/results/controller_ab.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from transformers import AutoTokenizer  # noqa: E402

from benchmarks.peer_bench.prompts import PROMPT_SETS  # noqa: E402
from benchmarks.peer_bench.workload import Conversation, Item, Request  # noqa: E402
from benchmarks.steady_state import params_of  # noqa: E402
from engine import LLM  # noqa: E402

ENGINES = ("default", "variant", "none")


def setting(text: str) -> tuple[str, float]:
    name, _, value = text.partition("=")
    if not value:
        raise argparse.ArgumentTypeError(f"--controller wants NAME=VALUE, got {text!r}")
    return name, float(value)


def run(llm: LLM, items: list[Item], concurrency: int, decode: Callable[[list[int]], str]
        ) -> tuple[float, int, list[list[list[int]]]]:
    """(wall seconds, tokens emitted, each item's token ids by turn) for ``items`` at ``concurrency`` in flight."""
    engine, pending, live, outputs, emitted = llm.engine, iter(enumerate(items)), {}, [[] for _ in items], 0

    def submit(index: int, prompt: str, turn: int) -> None:
        item = items[index]
        params = params_of(item if isinstance(item, Request) else "")
        request_id = f"ab-{time.perf_counter_ns()}"
        engine.add_prepared(request_id, engine.prepare(prompt, params), params)
        live[request_id] = (index, prompt, turn, [])

    def admit() -> None:
        index, item = next(pending, (None, None))
        if item is not None:
            first = item.first if isinstance(item, Conversation) else item.prompt if isinstance(item, Request) else item
            submit(index, first, 1)

    for _ in range(concurrency):
        admit()
    start = time.perf_counter()
    while live:
        for out in engine.step():
            if out.request_id not in live:
                continue
            index, prompt, turn, ids = live[out.request_id]
            ids.extend(out.new_token_ids)
            emitted += len(out.new_token_ids)
            if out.finished:
                del live[out.request_id]
                outputs[index].append(ids)
                item = items[index]
                if isinstance(item, Conversation) and turn < item.turns:
                    submit(index, item.next_prompt(prompt, decode(ids)), turn + 1)
                else:
                    admit()
    return time.perf_counter() - start, emitted, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=REPO_ROOT / "models" / "default")
    ap.add_argument("--set", default="agentic", choices=list(PROMPT_SETS))
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--per-round", type=int, default=8, help="prompts (conversations) a round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--controller", type=setting, action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--engine", type=setting, action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--compile", choices=("start", "background"), default="start",
                    help="background: only the graph files on disk (a host without its prompt graphs)")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "controller_ab.json")
    args = ap.parse_args()
    if not args.controller and not args.engine:
        ap.error("the variant needs a --controller or an --engine setting")

    tok = AutoTokenizer.from_pretrained(args.pair / "target")
    items = PROMPT_SETS[args.set](tok, args.per_round * args.rounds + 2)
    llms = {}
    for name in ENGINES:
        options = {key: int(value) for key, value in args.engine} if name == "variant" else {}
        # compile_prompts off: three children compiling the same prompt graphs would share the cores with the rounds
        llms[name] = LLM(str(args.pair / "target"), draft_model=str(args.pair / "draft"), compile=args.compile,
                         speculative_method="none" if name == "none" else "hybrid", compile_prompts=False, **options)
    for attr, value in args.controller:
        if not hasattr(llms["variant"].engine.controller, attr):
            ap.error(f"--controller: the goodput controller has no {attr!r}")
        current = getattr(llms["variant"].engine.controller, attr)
        setattr(llms["variant"].engine.controller, attr, type(current)(value))
    for llm in llms.values():  # a first request each, off the clock
        run(llm, items[:2], 2, tok.decode)
    tps: dict[str, list[float]] = collections.defaultdict(list)
    same = True
    for r in range(args.rounds):
        batch = items[2 + r * args.per_round: 2 + (r + 1) * args.per_round]
        order = ENGINES[r % 3:] + ENGINES[:r % 3]
        got = {}
        for name in order:
            seconds, emitted, got[name] = run(llms[name], batch, args.concurrency, tok.decode)
            tps[name].append(emitted / seconds)
        same &= got["default"] == got["variant"] == got["none"]
        print(f"round {r + 1}: default {tps['default'][-1] / tps['none'][-1]:.3f}x, "
              f"variant {tps['variant'][-1] / tps['none'][-1]:.3f}x of none", flush=True)
    median = {name: statistics.median(v) for name, v in tps.items()}
    ratios = {name: median[name] / median["none"] for name in ("default", "variant")}
    print(f"{args.set} at {args.concurrency}, {args.rounds} rounds of {args.per_round}:"
          f" default {ratios['default']:.3f}x,"
          f" variant ({', '.join(f'{a}={v:g}' for a, v in [*args.controller, *args.engine])})"
          f" {ratios['variant']:.3f}x of none;"
          f" same tokens: {same}")
    result = {"set": args.set, "concurrency": args.concurrency, "per_round": args.per_round, "rounds": args.rounds,
              "controller": dict(args.controller), "engine": dict(args.engine), "compile": args.compile,
              "tokens_per_second": dict(tps), "ratio_of_medians": ratios,
              "same_tokens": same, "host": platform.processor() or platform.machine()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.out.exists():  # one file, a run per (set, concurrency, setting)
        runs = [r for r in json.loads(args.out.read_text())
                if (r["set"], r["concurrency"], r["controller"], r.get("engine", {}))
                != (args.set, args.concurrency, result["controller"], result["engine"])]
    else:
        runs = []
    args.out.write_text(json.dumps([*runs, result], indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
