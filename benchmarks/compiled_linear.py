"""Compiled CPU forwards with each linear-layer path of engine/layers/small_linear.py, side by side in one process.

    python benchmarks/compiled_linear.py [--pair models/default] [--repeats 30] [--json PATH]

For the target and the draft of the pair, three runners compiled alike except for their linear layers:
``as built`` (the fused loop up to SMALL_ROWS rows, oneDNN with packed weights past it), ``mkl past 16``
(the loop, then F.linear, i.e. MKL's sgemm) and ``onednn always`` (packed oneDNN at every size). Each
layout is one forward of G sequences x Q tokens over contexts of 160-220 keys; the runners alternate, and
the table gives median ms per forward. Compiling takes a few minutes the first time (inductor's cache).

    python benchmarks/compiled_linear.py --engine [--rounds 3]

Whole engines instead: the default (hybrid) on the pair, compiled, with and without the packed weights (MKL
past 16 rows), built in one process and alternated over 8 held-out code prompts, one request at a time,
greedy, 128 new tokens; tokens/s per round and the medians.
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
from cpu_attention import BLOCKS, BS, scattered_batch  # this script's own directory is on sys.path
from peer_bench.prompts import code_prompts
from transformers import AutoTokenizer

from engine.layers import small_linear
from engine.layers.tracing import tracing
from engine.llm import LLM
from engine.types.sampling_params import SamplingParams
from engine.worker.forward_batch import ForwardBatch
from engine.worker.model_runner import ModelRunner

REPO_ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = [(1, 1), (1, 5), (2, 5), (4, 4), (4, 5), (8, 4), (32, 1), (32, 3)]  # (G sequences, Q tokens each)


class PackedAlways(small_linear.SmallRowsLinear):
    """Packed oneDNN at every row count, compiled (for the comparison only)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not tracing() or self.packed_key is None:
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // x.shape[-1]
        y = small_linear.packed_linear(x.reshape(rows, x.shape[-1]), self.weight, self.bias, self.packed_key)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def runner(path: Path, variant: str) -> ModelRunner:
    r = ModelRunner.load(str(path), "float32", "cpu", compile=True)
    r.allocate_cache(num_blocks=BLOCKS, block_size=BS)
    for m in r.model.modules():
        if isinstance(m, small_linear.SmallRowsLinear):
            if variant == "mkl past 16":
                m.packed_key = None
            elif variant == "onednn always":
                m.__class__ = PackedAlways
    return r


def compiled_batches(model: str, runners: dict[str, ModelRunner], layouts: list[tuple[int, int]]
                     ) -> dict[tuple[int, int], ForwardBatch]:
    """One batch per (G sequences, Q tokens) layout, each run once by every runner (compiling it the first time),
    their logits checked equal to the first runner's."""
    rng = random.Random(1)
    batches = {(G, Q): scattered_batch(rng, G, Q) for G, Q in layouts}
    for (G, Q), b in batches.items():
        t0 = time.perf_counter()
        outs = [r.forward(b) for r in runners.values()]
        for out in outs[1:]:
            torch.testing.assert_close(out, outs[0], atol=1e-4, rtol=1e-4)
        print(f"{model} {G}x{Q} compiled in {time.perf_counter() - t0:.0f} s", flush=True)
    return batches


def engines(pair: Path, rounds: int) -> None:
    tok = AutoTokenizer.from_pretrained(pair / "target")
    prompts = code_prompts(tok, 8)
    available = torch.backends.mkldnn.is_available
    llms = {}
    for name in ("packed past 16", "mkl past 16"):
        # small_linear.install packs only where oneDNN is available: saying it is not gives the MKL engine.
        torch.backends.mkldnn.is_available = available if name == "packed past 16" else (lambda: False)
        try:
            t0 = time.perf_counter()
            llms[name] = LLM(str(pair / "target"), draft_model=str(pair / "draft"), dtype="float32", device="cpu",
                             compile=True)
            llms[name].generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0))  # first-call paths
            print(f"{name}: ready in {time.perf_counter() - t0:.0f} s", flush=True)
        finally:
            torch.backends.mkldnn.is_available = available
    params = SamplingParams(max_tokens=128, temperature=0.0)
    rates: dict[str, list[float]] = {name: [] for name in llms}
    texts: dict[str, list[list[int]]] = {}
    for rnd in range(rounds):
        order = list(llms.items()) if rnd % 2 == 0 else list(llms.items())[::-1]
        for name, llm in order:
            t0, tokens, outs = time.perf_counter(), 0, []
            for p in prompts:
                ids = llm.generate([p], params)[0].token_ids
                tokens += len(ids)
                outs.append(list(ids))
            rates[name].append(tokens / (time.perf_counter() - t0))
            texts[name] = outs
        print(f"round {rnd + 1}: " + ", ".join(f"{n} {v[-1]:.1f} tok/s" for n, v in rates.items()), flush=True)
    same = sum(a == b for a, b in zip(*texts.values()))
    print("medians: " + ", ".join(f"{n} {statistics.median(v):.1f} tok/s" for n, v in rates.items())
          + f"; {same}/{len(prompts)} outputs identical")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=REPO_ROOT / "models" / "default")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "compiled_linear.json")
    ap.add_argument("--engine", action="store_true", help="whole engines, packed weights against MKL past 16 rows")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.engine:
        engines(args.pair, args.rounds)
        return
    variants = ("as built", "mkl past 16", "onednn always")
    rows = []
    with torch.inference_mode():
        for model in ("target", "draft"):
            runners = {v: runner(args.pair / model, v) for v in variants}
            batches = compiled_batches(model, runners, LAYOUTS)
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
