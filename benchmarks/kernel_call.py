"""What a precompiled graph's direct call into its inductor function saves per forward (engine.worker.kernel_call),
against torch's own call through AOTAutograd's runtime wrapper.

    python benchmarks/kernel_call.py [--repeats 200] [--serve-args "..."] [--json PATH]

The default server's engine with its graph files loaded (shipped, or written by an earlier start) runs every
warm-up layout of each model (the layouts its graphs were compiled for: decodes, verifies and catch-ups of one
sequence, and batches) before any request, so no block holds anyone's K/V. For each layout the two calls alternate
forward by forward, so machine noise and the cache state a forward leaves behind hit both alike; the table gives the
median ms of each, the saving, and whether the two gave the same logits bit for bit (they run the same kernel on the
same arguments).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine import LLM  # noqa: E402
from engine.worker.compile_cache import machine  # noqa: E402
from engine.worker.warm_up_layouts import warm_up_layouts  # noqa: E402
from server.cli import parse_config  # noqa: E402

ARMS = ("torch's call", "direct")


def swaps(runner: Any) -> list[tuple[dict[str, Any], str, Any, Any]]:
    """Per graph of ``runner`` that calls its kernel directly: (the bytecode's globals, the name, torch's call,
    ours)."""
    out = []
    for group in runner.compiled.precompiled.graphs.values():
        for fn in group:
            scope, name = fn.fn.__globals__, fn._artifacts.backend_id
            ours = scope[name]
            if hasattr(ours, "__wrapped__"):
                out.append((scope, name, ours.__wrapped__, ours))
    return out


def arm(graphs: list[tuple[dict[str, Any], str, Any, Any]], direct: bool) -> None:
    for scope, name, torchs, ours in graphs:
        scope[name] = ours if direct else torchs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=200, help="forwards of each arm per layout")
    ap.add_argument("--serve-args", default="", help="options of specd serve")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "kernel_call.json")
    args = ap.parse_args()

    llm = LLM(parse_config(["serve", *shlex.split(args.serve_args)]).engine_config())
    engine = llm.engine
    runners = {"target": engine.target, **{d.name: d.runner for d in engine.drafting.drafters
                                           if getattr(d, "runner", None) is not None}}
    rows = []
    print("| model | sequences x tokens | logits rows | torch's call ms | direct ms | saved ms | same logits |")
    print("|---|---|---|---|---|---|---|")
    for name, runner in runners.items():
        if runner.compiled is None or runner.compiled.precompiled is None:
            sys.exit(f"no graph files loaded for {name}: start `make serve` once and let it compile")
        graphs = swaps(runner)
        if not graphs:
            sys.exit(f"no graph of {name} calls its kernel directly")
        # No request has run: no block holds anyone's K/V, so the layouts may write anywhere.
        layouts = warm_up_layouts(engine.config.k_max, runner.cache.block_size, runner.cache.num_blocks)
        for batch in layouts:
            calls = runner.compiled.calls
            logits = []
            for direct in (False, True):
                arm(graphs, direct)
                logits.append(runner.forward(batch).clone())
            if runner.compiled.calls != calls + 2:
                continue  # a layout this model's graphs leave out (the draft's verifies): it ran eagerly
            times: dict[bool, list[float]] = {False: [], True: []}
            for i in range(2 * args.repeats):
                direct = bool(i % 2)
                arm(graphs, direct)
                t0 = time.perf_counter()
                runner.forward(batch)
                times[direct].append(time.perf_counter() - t0)
            arm(graphs, True)
            torchs, ours = (1e3 * statistics.median(times[d]) for d in (False, True))
            lens = sorted({len(t) for t in batch.token_ids})
            row = {"model": name, "sequences": len(batch.token_ids), "tokens": lens, "rows": sum(batch.logits_rows),
                   "torch_ms": torchs, "direct_ms": ours, "same_logits": bool(torch.equal(*logits))}
            rows.append(row)
            shape = f"{row['sequences']} x {'/'.join(map(str, lens))}"
            print(f"| {name} | {shape} | {row['rows']} | {torchs:.3f} | {ours:.3f} | {torchs - ours:.3f} | "
                  f"{'yes' if row['same_logits'] else 'NO'} |", flush=True)
    for name in runners:
        # The few-row layouts are what a batch-1 step runs, and where a fixed cost shows: at 65-160 rows a forward
        # takes 5-80 ms and its rounds swing by more than the saving.
        for label, few in (("up to 16 rows", True), ("more", False)):
            saved = [r["torch_ms"] - r["direct_ms"] for r in rows
                     if r["model"] == name and (r["sequences"] * max(r["tokens"]) <= 16) == few]
            if saved:
                print(f"{name}, {label}: median saving {statistics.median(saved):.3f} ms a forward over "
                      f"{len(saved)} layouts")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": {**machine(), "node": platform.node()}, "threads":
                                     torch.get_num_threads(), "repeats": args.repeats, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
