#!/usr/bin/env python
"""llama.cpp's draft settings on the embedded pair: which --spec-draft-n-max / --spec-draft-p-min to
compare specd against (peer_bench/systems.py's LLAMACPP_DRAFT).

    python benchmarks/llamacpp/draft_sweep.py                     # ~10 min on 2 cores
    python benchmarks/llamacpp/draft_sweep.py --settings 3:0 8:0 --concurrency 1 --rounds 1

All servers are up at once and the rounds interleave them, as in compare.py (and a run during which
other processes took over 10% of the CPU is measured again); code prompts, greedy, 128 new tokens.
Writes benchmarks/results/llamacpp_draft_sweep.json and prints a markdown table:
tokens/s (median over rounds), the ratio to llama.cpp without a draft (median of per-round ratios),
acceptance per drafted token and mean tokens per verification step, from llama-server's /metrics.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from peer_bench import client  # noqa: E402
from peer_bench.prompts import code_prompts  # noqa: E402
from peer_bench.systems import Running, System, llamacpp_missing, llamacpp_systems  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

DEFAULT_PAIR = ROOT / "models" / "default"
NONE = "no draft"


def variants(target: str, draft: str, threads: int, slots: int, settings: list[str]) -> list[System]:
    """llama.cpp without a draft, and with it at each N:P (n-max N, p-min P)."""
    out = [replace(llamacpp_systems(target, draft, threads, slots)[1], name=NONE)]
    for s in settings:
        n, p = s.split(":")
        flags = ("--spec-type", "draft-simple", "--spec-draft-n-max", n, "--spec-draft-n-min", "0",
                 "--spec-draft-p-min", p)
        out.append(replace(llamacpp_systems(target, draft, threads, slots, flags)[0], name=f"n-max {n} p-min {p}"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(DEFAULT_PAIR / "target"))
    ap.add_argument("--draft", default=str(DEFAULT_PAIR / "draft"))
    ap.add_argument("--settings", nargs="+", default=["3:0", "4:0", "8:0", "8:0.5", "8:0.75"],
                    help="N:P pairs of --spec-draft-n-max and --spec-draft-p-min (default: llama.cpp's 3:0 and others)")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "llamacpp_draft_sweep.json")
    args = ap.parse_args()
    missing = llamacpp_missing("cpu")
    if missing:
        sys.exit(missing)

    tok = AutoTokenizer.from_pretrained(args.target)
    prompts = code_prompts(tok, max(8, *(2 * c for c in args.concurrency if c > 1)))
    chosen = variants(args.target, args.draft, args.threads, max(args.concurrency), args.settings)
    log_dir = Path(tempfile.mkdtemp(prefix="llamacpp-sweep-"))
    running = [Running(s, log_dir) for s in chosen]
    rows = []
    try:
        for r in running:
            r.wait_ready()
            client.run(r, prompts[:1], 16, 1)
        for rnd in range(args.rounds):
            order = running[rnd % len(running):] + running[: rnd % len(running)]
            for conc in args.concurrency:
                for r in order:
                    run = client.measure(r, prompts[: 8 if conc == 1 else 2 * conc], 128, conc, 0.1, 3)
                    tokens = sum(len(tok.encode(x.text, add_special_tokens=False)) for x in run.results if x.ok)
                    rows.append({"round": rnd, "concurrency": conc, "setting": r.system.name,
                                 "tokens_per_s": tokens / run.seconds, "counters": run.counters,
                                 "foreign_cpu": run.foreign_cpu, "failed": sum(not x.ok for x in run.results)})
                    print(f"round {rnd + 1} c{conc:<3d} {r.system.name:20s} {rows[-1]['tokens_per_s']:7.1f} tok/s  "
                          f"others' cpu {run.foreign_cpu or 0:.0%}", flush=True)
    finally:
        for r in running:
            r.stop()
    lines = summarize(rows)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": lines,
                                    "rows": rows}, indent=1))
    print("\n" + table(lines) + f"\n\nwrote {args.out}")


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for conc, setting in dict.fromkeys((r["concurrency"], r["setting"]) for r in rows):
        sel = [r for r in rows if (r["concurrency"], r["setting"]) == (conc, setting)]
        base = {r["round"]: r["tokens_per_s"] for r in rows if (r["concurrency"], r["setting"]) == (conc, NONE)}
        drafts, drafted, accepted = (sum(r["counters"].get(k, 0.0) for r in sel) for k in client.SPECD_COUNTERS[:3])
        out.append({"concurrency": conc, "setting": setting,
                    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in sel),
                    "vs_no_draft": statistics.median(r["tokens_per_s"] / base[r["round"]] for r in sel),
                    "acceptance": accepted / drafted if drafted else None,
                    "tokens_per_step": 1 + accepted / drafts if drafts else None,
                    "max_foreign_cpu": max((r["foreign_cpu"] or 0.0) for r in sel)})
    return out


def table(lines: list[dict]) -> str:
    def fmt(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    head = "| conc | llama.cpp draft | tok/s | vs no draft | acceptance | tokens/step |\n|" + "---|" * 6
    return head + "\n" + "\n".join(
        f"| {x['concurrency']} | {x['setting']} | {x['tokens_per_s']:.1f} | {x['vs_no_draft']:.2f} "
        f"| {fmt(x['acceptance'], '.3f')} | {fmt(x['tokens_per_step'], '.2f')} |" for x in lines)


if __name__ == "__main__":
    main()
