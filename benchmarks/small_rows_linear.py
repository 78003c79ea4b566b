"""Compiled CPU forwards of the embedded pair from 1 to 16 rows, with the few-rows linear kernel
(engine/layers/kernels/small_rows_linear.cpp, as built) and without it (the fused multiply-reduce loop inductor
generates, the path before the kernel), side by side in one process.

    python benchmarks/small_rows_linear.py [--pair models/default] [--rounds 15] [--json PATH]

Each layout is one forward of G sequences x Q tokens over contexts of 160-220 keys, as a running server's cache
holds them: one sequence verifying Q - 1 drafts, or a few sequences verifying. The two runners alternate forward by
forward, 5 forwards a turn; the table gives the median ms per forward over the rounds and its ratio. Per row past
the first: the slope of the one-sequence layouts' times, which is what a drafted token costs the target's forward.
Compiling takes a few minutes the first time (inductor's cache).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from compiled_linear import compiled_batches  # this script's own directory is on sys.path
from cpu_attention import BLOCKS, BS

from engine.layers import small_linear
from engine.worker.model_runner import ModelRunner

REPO_ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = [(1, 1), (1, 2), (1, 3), (1, 5), (1, 9), (1, 12), (1, 16), (2, 5), (4, 4)]  # (G sequences, Q tokens)
ARMS = ("kernel", "fused loop")


class FusedLoop(small_linear.SmallRowsLinear):
    few_rows_kernel = False


def runner(path: Path, arm: str) -> ModelRunner:
    r = ModelRunner.load(str(path), "float32", "cpu", compile=True)
    r.allocate_cache(num_blocks=BLOCKS, block_size=BS)
    if arm == "fused loop":
        for m in r.model.modules():
            if isinstance(m, small_linear.SmallRowsLinear):
                m.__class__ = FusedLoop
    return r


def slope(rows: list[dict], arm: str) -> float:
    """ms per row past the first, least squares over the one-sequence layouts."""
    pts = [(r["G"] * r["Q"], r[arm]) for r in rows if r["G"] == 1]
    mx, my = statistics.fmean(x for x, _ in pts), statistics.fmean(y for _, y in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=REPO_ROOT / "models" / "default")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "small_rows_linear.json")
    args = ap.parse_args()
    if not small_linear.rows_kernel():
        raise SystemExit("the few-rows kernel could not be built here (see the log): nothing to compare")
    rows: list[dict] = []
    slopes: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for model in ("target", "draft"):
            runners = {arm: runner(args.pair / model, arm) for arm in ARMS}
            batches = compiled_batches(model, runners, LAYOUTS)
            times: dict[tuple, list[float]] = {(k, arm): [] for k in batches for arm in ARMS}
            for rnd in range(args.rounds):
                for k, b in batches.items():
                    for arm in ARMS if rnd % 2 == 0 else ARMS[::-1]:
                        t0 = time.perf_counter()
                        for _ in range(5):
                            runners[arm].forward(b)
                        times[(k, arm)].append((time.perf_counter() - t0) / 5)
            mine = [{"model": model, "G": G, "Q": Q, **{arm: 1e3 * statistics.median(times[((G, Q), arm)])
                                                        for arm in ARMS}} for G, Q in batches]
            rows += mine
            slopes[model] = {arm: slope(mine, arm) for arm in ARMS}
            uncompiled = [r.compiled.uncompiled for r in runners.values()]
            if any(uncompiled):
                print(f"warning: {model} ran {uncompiled} forwards uncompiled")
    print(f"\ncompiled forwards, ms (median of {args.rounds} rounds, {torch.get_num_threads()} threads, float32)\n")
    print("| model | sequences x tokens | rows | kernel | fused loop | fused / kernel |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['G']} x {r['Q']} | {r['G'] * r['Q']} | {r['kernel']:.2f} | {r['fused loop']:.2f} "
              f"| {r['fused loop'] / r['kernel']:.2f}x |")
    for model, s in slopes.items():
        print(f"{model}: per row past the first, kernel {s['kernel']:.3f} ms, fused loop {s['fused loop']:.3f} ms")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                     "threads": torch.get_num_threads(), "torch": torch.__version__,
                                     "rounds": args.rounds, "rows": rows, "ms_per_row": slopes}, indent=2) + "\n")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
