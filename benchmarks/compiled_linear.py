"""Compiled CPU forwards with each linear-layer path of engine/small_linear.py, side by side in one process.

    python benchmarks/compiled_linear.py [--pair models/default] [--repeats 30] [--json PATH]

For the target and the draft of the pair, three runners compiled alike except for their linear layers:
``as built`` (the fused loop up to SMALL_ROWS rows, oneDNN with packed weights past it), ``mkl past 16``
(the loop, then F.linear, i.e. MKL's sgemm) and ``onednn always`` (packed oneDNN at every size). Each
layout is one forward of G sequences x Q tokens over contexts of 160-220 keys; the runners alternate, and
the table gives median ms per forward. Compiling takes a few minutes the first time (inductor's cache).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine import small_linear
from engine.model_runner import ForwardBatch, ModelRunner

REPO_ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = [(1, 1), (1, 5), (2, 5), (4, 4), (4, 5), (8, 4), (32, 1), (32, 3)]  # (G sequences, Q tokens each)


class PackedAlways(small_linear.SmallRowsLinear):
    """Packed oneDNN at every row count, compiled (for the comparison only)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling() or self.packed_key is None:
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // x.shape[-1]
        y = small_linear.packed_linear(x.reshape(rows, x.shape[-1]), self.weight, self.bias, self.packed_key)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def runner(path: Path, variant: str) -> ModelRunner:
    r = ModelRunner(str(path), "float32", "cpu", compile=True)
    r.allocate_cache(num_blocks=1200, block_size=16)
    for m in r.model.modules():
        if isinstance(m, small_linear.SmallRowsLinear):
            if variant == "mkl past 16":
                m.packed_key = None
            elif variant == "onednn always":
                m.__class__ = PackedAlways
    return r


def batch(rng: random.Random, G: int, Q: int) -> ForwardBatch:
    ends = [rng.randint(160, 220) for _ in range(G)]
    free = rng.sample(range(1200), sum(-(-(e + Q) // 16) for e in ends))
    tables = []
    for e in ends:
        n = -(-(e + Q) // 16)
        tables.append(free[:n])
        free = free[n:]
    return ForwardBatch([[7] * Q] * G, ends, tables, [Q] * G)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=REPO_ROOT / "models" / "default")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "compiled_linear.json")
    args = ap.parse_args()
    variants = ("as built", "mkl past 16", "onednn always")
    rows = []
    with torch.inference_mode():
        for model in ("target", "draft"):
            runners = {v: runner(args.pair / model, v) for v in variants}
            rng = random.Random(1)
            batches = {(G, Q): batch(rng, G, Q) for G, Q in LAYOUTS}
            for (G, Q), b in batches.items():
                t0 = time.perf_counter()
                outs = {v: r.forward(b) for v, r in runners.items()}  # compiles each layout the first time
                for v in variants[1:]:
                    torch.testing.assert_close(outs[v], outs[variants[0]], atol=1e-4, rtol=1e-4)
                print(f"{model} {G}x{Q} compiled in {time.perf_counter() - t0:.0f} s", flush=True)
            for (G, Q), b in batches.items():
                times: dict[str, list[float]] = {v: [] for v in variants}
                for _ in range(args.repeats):
                    for v, r in runners.items():
                        t0 = time.perf_counter()
                        r.forward(b)
                        times[v].append(time.perf_counter() - t0)
                row = {"model": model, "G": G, "Q": Q, **{v: 1e3 * statistics.median(t) for v, t in times.items()}}
                rows.append(row)
            eager = [r.compiled.uncompiled for r in runners.values()]
            if any(eager):
                print(f"warning: {model} ran {eager} forwards uncompiled")
    print(f"\ncompiled forwards, ms (median of {args.repeats}, {torch.get_num_threads()} threads, float32)")
    print(f"{'model':>6} {'G':>3} {'Q':>2} {'rows':>4} " + " ".join(f"{v:>13}" for v in variants))
    for r in rows:
        times = " ".join(f"{r[v]:>13.2f}" for v in variants)
        print(f"{r['model']:>6} {r['G']:>3} {r['Q']:>2} {r['G'] * r['Q']:>4} {times}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
