"""Per-forward cost of the target and the draft, eager against compiled, beside the weight-read floor.

    python benchmarks/forward_cost.py [--pair models/default] [--repeats 300] [--json PATH]

For each model: the median time of one decode forward (1 token) and one verify forward (k + 1 tokens)
through specd's ModelRunner over a paged cache at a 128-token context, eager and with torch.compile
(engine.worker.compiled), measured alternately in one process so machine noise hits both alike. The floor is
the bytes of the weights divided by the memory copy bandwidth measured here (a large tensor copied),
the least any implementation must pay per forward at batch 1. The draft cost ratio c is the draft's
decode forward over the target's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine.worker.forward_batch import ForwardBatch
from engine.worker.model_runner import ModelRunner

REPO_ROOT = Path(__file__).resolve().parents[1]
CONTEXT, K = 128, 4


def copy_bandwidth() -> float:
    """Bytes per second for reading and writing a 256 MiB float32 tensor (median of 5)."""
    src = torch.empty(64 * 2**20)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / statistics.median(times)  # read + write


def median_ms(runner: ModelRunner, n_tokens: int, repeats: int) -> float:
    table = list(range(-(-(CONTEXT + K + 1) // 16)))
    times = []
    for i in range(repeats):
        batch = ForwardBatch([[7] * n_tokens], [CONTEXT - (i % 8)], [table], [n_tokens])
        t0 = time.perf_counter()
        runner.forward(batch)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=REPO_ROOT / "models" / "default")
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--json", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "forward_cost.json")
    args = ap.parse_args()
    bandwidth = copy_bandwidth()
    rows = {}
    for name in ("target", "draft"):
        runners = {}
        for mode in ("eager", "compiled"):
            runner = ModelRunner.load(str(args.pair / name), "float32", "cpu", compile=mode == "compiled")
            runner.allocate_cache(64, 16)
            runner.forward(ForwardBatch([list(range(5, 5 + CONTEXT))], [0], [list(range(16))], [1]))
            seconds = runner.warm_up_compiled(K)
            print(f"{name} {mode}: ready (compile {seconds:.1f}s)", flush=True)
            runners[mode] = runner
        weight_bytes = sum(p.numel() * p.element_size() for p in runners["eager"].model.parameters())
        figures: dict[str, float] = {"weight_mb": weight_bytes / 1e6, "floor_ms": 1e3 * weight_bytes / bandwidth}
        for label, n in (("decode", 1), ("verify", K + 1)):
            samples: dict[str, list[float]] = {"eager": [], "compiled": []}
            for _ in range(3):  # alternate, so drift hits both
                for mode, runner in runners.items():
                    samples[mode].append(median_ms(runner, n, args.repeats // 3))
            for mode in samples:
                figures[f"{label}_{mode}_ms"] = statistics.median(samples[mode])
        rows[name] = figures
    c = {m: rows["draft"][f"decode_{m}_ms"] / rows["target"][f"decode_{m}_ms"] for m in ("eager", "compiled")}
    threads = torch.get_num_threads()
    print(f"\ncopy bandwidth {bandwidth / 1e9:.1f} GB/s; context {CONTEXT}; k = {K}; threads {threads}\n")
    print("| model | weights MB | floor ms | decode eager ms | decode compiled ms | verify eager ms "
          "| verify compiled ms |")
    print("|---|---|---|---|---|---|---|")
    for name, f in rows.items():
        print(f"| {name} | {f['weight_mb']:.1f} | {f['floor_ms']:.2f} | {f['decode_eager_ms']:.2f} | "
              f"{f['decode_compiled_ms']:.2f} | {f['verify_eager_ms']:.2f} | {f['verify_compiled_ms']:.2f} |")
    print(f"\ndraft cost ratio c (draft decode / target decode): eager {c['eager']:.2f}, compiled {c['compiled']:.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"bandwidth_gbps": bandwidth / 1e9, "models": rows, "c": c}, indent=1))


if __name__ == "__main__":
    main()
