#!/usr/bin/env python
"""Tensor parallelism on this host: the embedded target sharded over 2 ranks (CPU processes, gloo) against one
rank, and where the draft model costs least: whole on rank 0, or sharded like the target.

    python benchmarks/tensor_parallel.py              # ~6 min on 2 cores
    python benchmarks/tensor_parallel.py --rounds 1   # a quick look

Every configuration runs in a fresh process (a process joins one set of ranks, and joining sets its thread
count), in interleaved rounds; figures are medians over the rounds. Greedy decoding of 8 code prompts cut from
this repository's engine/ (64 tokens each, 64 new tokens, `--compile off`):

- **target**: tokens/s at batch 1 (one prompt at a time) and batch 8, with no speculation and with the draft
  model at k = 4, on 1 rank (all the host's threads) and on 2 ranks (half the threads each: the ranks share the
  host's cores). On one host's CPU the bound of 2 ranks over 1 is 1.0x: the same cores do the same arithmetic,
  and the ranks add messages and all-reduces. On GPUs each rank brings its own memory bandwidth, the bound of a
  memory-bound decode is N x; what this measures here is the overhead.
- **message**: rank 0's cost per target forward of telling the other ranks the step (pickling it and a gloo
  broadcast), measured around ``Leader.forward``.
- **draft placement**: the draft model's decode forward (batch 1) whole on one rank with rank 0's share of the
  threads, against the draft sharded over 2 ranks (what a sharded draft would pay per drafted token).

Writes benchmarks/results/tensor_parallel.json and benchmarks/results/tensor_parallel.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET, DRAFT = ROOT / "models/default/target", ROOT / "models/default/draft"
PROMPT_TOKENS, NEW_TOKENS = 64, 64
CONFIGS = {  # name -> (model, ranks, method)
    "target 1 rank": ("target", 1, "none"),
    "target 2 ranks": ("target", 2, "none"),
    "target+draft 1 rank": ("target", 1, "draft_model"),
    "target+draft 2 ranks": ("target", 2, "draft_model"),
    "draft whole, rank 0's threads": ("draft", 1, "none"),
    "draft sharded over 2 ranks": ("draft", 2, "none"),
}


def prompts(tokenizer) -> list[list[int]]:  # noqa: ANN001
    files = sorted((ROOT / "engine").rglob("*.py"))[:40:5]
    return [tokenizer.encode(f.read_text())[:PROMPT_TOKENS] for f in files]


def one(name: str) -> dict:
    """Run one configuration in this process; its figures."""
    import torch

    from engine import LLM, SamplingParams

    model, ranks, method = CONFIGS[name]
    threads = os.cpu_count() or 1
    if ranks == 1:
        # A whole draft measured as rank 0 would run it: with rank 0's share of the threads.
        torch.set_num_threads(threads // 2 if model == "draft" else threads)
    options = dict(compile="off", device="cpu", speculative_method=method)
    if method == "draft_model":
        options.update(draft_model=str(DRAFT), num_speculative_tokens=4)
    llm = LLM(str(TARGET if model == "target" else DRAFT), tensor_parallel_size=ranks, **options)
    ps = prompts(llm.engine.tokenizer)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate(ps[:2], greedy)  # warm-up
    said, calls = [0.0], [0]
    leader = llm.engine.target.leader
    if leader is not None:
        tell = leader.forward

        def timed(batch):  # noqa: ANN001, ANN202
            t = time.perf_counter()
            tell(batch)
            said[0] += time.perf_counter() - t
            calls[0] += 1

        leader.forward = timed
    out: dict = {"name": name, "threads": torch.get_num_threads()}
    t = time.perf_counter()
    for p in ps:
        llm.generate([p], greedy)
    out["batch_1_tokens_per_s"] = len(ps) * NEW_TOKENS / (time.perf_counter() - t)
    t = time.perf_counter()
    llm.generate(ps, greedy)
    out["batch_8_tokens_per_s"] = len(ps) * NEW_TOKENS / (time.perf_counter() - t)
    out["ms_per_token_batch_1"] = 1000 / out["batch_1_tokens_per_s"]
    if calls[0]:
        out["message_ms_per_forward"] = 1000 * said[0] / calls[0]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/tensor_parallel.json"))
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return 0
    runs: list[dict] = []
    for r in range(args.rounds):
        for name in CONFIGS:
            proc = subprocess.run([sys.executable, __file__, "--one", name], cwd=ROOT, capture_output=True,
                                  text=True, timeout=600, env={**os.environ, "SPECD_LOG_LEVEL": "warning"})
            if proc.returncode != 0:
                raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
            run = json.loads(proc.stdout.strip().splitlines()[-1]) | {"round": r}
            runs.append(run)
            print(f"round {r} {name}: {run['batch_1_tokens_per_s']:.0f} / {run['batch_8_tokens_per_s']:.0f} tok/s",
                  flush=True)
    keys = ("batch_1_tokens_per_s", "batch_8_tokens_per_s", "ms_per_token_batch_1", "message_ms_per_forward")
    summary = {name: {k: statistics.median(r[k] for r in runs if r["name"] == name and k in r) for k in keys
                      if any(k in r for r in runs if r["name"] == name)} for name in CONFIGS}
    for pair in (("target 2 ranks", "target 1 rank"), ("target+draft 2 ranks", "target+draft 1 rank")):
        for k in ("batch_1_tokens_per_s", "batch_8_tokens_per_s"):
            summary[pair[0]][f"{k}_ratio"] = summary[pair[0]][k] / summary[pair[1]][k]
    print("\n| configuration | batch 1 tok/s | batch 8 tok/s | 2 ranks / 1 (bound 1.0x here) | message ms |")
    print("|---|---|---|---|---|")
    for name, s in summary.items():
        ratio = (f"{s['batch_1_tokens_per_s_ratio']:.2f}x / {s['batch_8_tokens_per_s_ratio']:.2f}x"
                 if "batch_1_tokens_per_s_ratio" in s else "")
        msg = f"{s['message_ms_per_forward']:.2f}" if "message_ms_per_forward" in s else ""
        print(f"| {name} | {s['batch_1_tokens_per_s']:.0f} | {s['batch_8_tokens_per_s']:.0f} | {ratio} | {msg} |")
    result = {"rounds": args.rounds, "cpu_count": os.cpu_count(), "prompt_tokens": PROMPT_TOKENS,
              "new_tokens": NEW_TOKENS, "summary": summary, "runs": runs}
    Path(args.out).write_text(json.dumps(result, indent=1))
    plot(summary, Path(args.out).with_suffix(".png"))
    return 0


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in CONFIGS if n.startswith("target")]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.38
    for i, k in enumerate(("batch_1_tokens_per_s", "batch_8_tokens_per_s")):
        ax.bar([j + i * width for j in range(len(names))], [summary[n][k] for n in names], width,
               label=k.split("_tokens")[0].replace("_", " "))
    ax.set_xticks([j + width / 2 for j in range(len(names))], names, fontsize=8)
    ax.set_ylabel("tokens/s (median)")
    ax.set_title("embedded target, 1 rank vs 2 ranks on one 2-core host (bound: 1.0x)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
