"""The CPU attention kernel (engine/layers/cpu_attention.py) against the gather + SDPA path it replaces.

    python benchmarks/cpu_attention.py [--pair models/default] [--repeats 40] [--json PATH]

Two tables, each measured alternately in one process (kernel, gather, kernel, ...) so machine noise hits both:
1. one layer's attention at the target's head layout, for batches of G sequences x Q queries over contexts of
   C - 60 .. C keys in scattered blocks of 16 (as a running server's cache holds them);
2. whole forwards of the target through ModelRunner (eager) on such batches: a decode step (1 token per
   sequence), a verify step (5 tokens per sequence), and steps whose sequences feed unequal numbers of tokens
   (some verifying, the rest decoding; one short prompt chunk among decodes), with the kernel on and off. In
   the last, the short group pads every sequence to the longest query: the kernel skips a padding row's keys.
The weight-read floor of a forward (its bytes over the copy bandwidth measured here) is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from forward_cost import copy_bandwidth  # this script's own directory is on sys.path

from engine.layers import cpu_attention
from engine.worker.forward_batch import ForwardBatch
from engine.worker.model_runner import ModelRunner

REPO_ROOT = Path(__file__).resolve().parents[1]
BS = 16


def _gather_sdpa(q, k_cache, v_cache, slots, positions, scale) -> torch.Tensor:
    """What engine.layers.attention does without the kernel: [G, Q, H, D]."""
    G, C = slots.shape
    k = k_cache.index_select(0, slots.view(-1)).view(G, C, *k_cache.shape[1:]).permute(0, 2, 1, 3)
    v = v_cache.index_select(0, slots.view(-1)).view(G, C, *v_cache.shape[1:]).permute(0, 2, 1, 3)
    mask = (torch.arange(C)[None, None, :] <= positions[:, :, None])[:, None]
    return F.scaled_dot_product_attention(q.permute(0, 2, 1, 3), k, v, attn_mask=mask, scale=scale).permute(0, 2, 1, 3)


def _alternated(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def layer_table(H: int, Hkv: int, D: int, repeats: int) -> list[dict]:
    rng = random.Random(0)
    blocks = 8192
    k_cache, v_cache = torch.randn(blocks * BS, Hkv, D), torch.randn(blocks * BS, Hkv, D)
    rows = []
    for G, Q, C in [(1, 1, 224), (1, 5, 224), (8, 1, 224), (8, 5, 224), (32, 1, 224), (32, 5, 224), (64, 1, 400)]:
        nb = -(-C // BS)
        tables = torch.tensor(rng.sample(range(blocks), G * nb)).view(G, nb)
        slots = (tables[:, :, None] * BS + torch.arange(BS)).view(G, -1)[:, :C].contiguous()
        ends = torch.tensor([C] + [rng.randint(C - 60, C) for _ in range(G - 1)])
        positions = ends[:, None] - Q + torch.arange(Q)[None]
        args = (torch.randn(G, Q, H, D), k_cache, v_cache, slots, positions, D**-0.5)
        torch.testing.assert_close(cpu_attention.paged_attention(*args), _gather_sdpa(*args), atol=1e-4, rtol=1e-4)
        ms = _alternated({"kernel": lambda a=args: cpu_attention.paged_attention(*a),
                          "gather": lambda a=args: _gather_sdpa(*a)}, repeats)
        rows.append({"G": G, "Q": Q, "C": C, "kernel_ms": ms["kernel"], "gather_sdpa_ms": ms["gather"]})
    return rows


BLOCKS = 1200  # the whole-forward runs' cache, in blocks of BS


def scattered_batch(rng: random.Random, G: int, Q: int | list[int]) -> ForwardBatch:
    """G sequences with 160-220 tokens cached, feeding Q tokens each (or Q[i]), their blocks scattered over a
    cache of BLOCKS blocks as a running server's cache holds them (benchmarks/compiled_linear.py uses it too)."""
    qs = Q if isinstance(Q, list) else [Q] * G
    ends = [rng.randint(160, 220) for _ in range(G)]
    free = rng.sample(range(BLOCKS), sum(-(-(e + q) // BS) for e, q in zip(ends, qs)))
    tables = []
    for e, q in zip(ends, qs):
        n = -(-(e + q) // BS)
        tables.append(free[:n])
        free = free[n:]
    return ForwardBatch([[7] * q for q in qs], ends, tables, qs)


# Batches whose sequences feed unequal numbers of tokens, padded into one short group: 64 sequences of which some
# verify 8 drafts (the goodput controller speculates for some sequences only) or one feeds a short prompt chunk.
MIXED = {"8 of 64 verify 8": [9] * 8 + [1] * 56, "20 of 64 verify 8": [9] * 20 + [1] * 44,
         "1 of 64 feeds 26": [26] + [1] * 63}


def forward_table(target: Path, repeats: int) -> list[dict]:
    runner = ModelRunner.load(str(target), "float32", "cpu")
    runner.allocate_cache(num_blocks=BLOCKS, block_size=BS)
    rng = random.Random(1)
    usable = cpu_attention.usable
    rows = []
    cases: list[tuple[int, int | list[int]]] = [(1, 1), (8, 1), (8, 5), (32, 1), (32, 5)]
    for G, Q in cases + [(len(qs), qs) for qs in MIXED.values()]:
        batch = scattered_batch(rng, G, Q)

        def run(on: bool, b: ForwardBatch = batch) -> None:
            cpu_attention.usable = usable if on else (lambda *a: False)
            try:
                runner.forward(b)
            finally:
                cpu_attention.usable = usable

        ms = _alternated({"kernel": lambda: run(True), "gather": lambda: run(False)}, repeats)
        q = Q if isinstance(Q, int) else next(name for name, qs in MIXED.items() if qs == Q)
        rows.append({"G": G, "Q": q, "context": f"{min(batch.starts)}-{max(batch.starts)}", "kernel_ms": ms["kernel"],
                     "gather_sdpa_ms": ms["gather"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=REPO_ROOT / "models" / "default")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--json", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "cpu_attention.json")
    args = ap.parse_args()
    if cpu_attention.kernel() is None:
        raise SystemExit("the CPU attention kernel could not be built here (see the log)")
    config = json.loads((args.pair / "target" / "config.json").read_text())
    H, Hkv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    D = config.get("head_dim", config["hidden_size"] // H)
    layers = layer_table(H, Hkv, D, args.repeats)
    print(f"one layer's attention, {H} heads ({Hkv} KV) of {D}, float32, {torch.get_num_threads()} threads (ms)")
    print(f"{'G':>3} {'Q':>2} {'C':>4} {'kernel':>8} {'gather+SDPA':>12} {'ratio':>6}")
    for r in layers:
        print(f"{r['G']:>3} {r['Q']:>2} {r['C']:>4} {r['kernel_ms']:>8.3f} {r['gather_sdpa_ms']:>12.3f} "
              f"{r['gather_sdpa_ms'] / r['kernel_ms']:>6.1f}")
    target = ModelRunner.load(str(args.pair / "target"), "float32", "cpu")
    weights = sum(p.numel() * 4 for p in target.model.parameters())
    floor = 1e3 * weights / copy_bandwidth()
    forwards = forward_table(args.pair / "target", args.repeats)
    print(f"\nwhole target forwards, eager (ms); weight-read floor {floor:.2f} ms")
    print(f"{'G':>3} {'Q':>2} {'context':>8} {'kernel':>8} {'gather+SDPA':>12} {'ratio':>6}")
    for r in forwards:
        print(f"{r['G']:>3} {str(r['Q']):>2} {r['context']:>8} {r['kernel_ms']:>8.2f} {r['gather_sdpa_ms']:>12.2f} "
              f"{r['gather_sdpa_ms'] / r['kernel_ms']:>6.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"threads": torch.get_num_threads(), "floor_ms": floor, "layer": layers,
                                     "forward": forwards}, indent=2) + "\n")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
