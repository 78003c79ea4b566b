"""The results: one row per configuration and batch size, rendered as the markdown report."""

from __future__ import annotations

import argparse
import math
import statistics

from . import BATCH, VERIFY_SIZES
from .bound import alpha_geo, bound, expected, paired_speedup, verify_factor
from .configs import Config, SpecdConfig


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def summarize(configs: list[Config]) -> list[dict]:
    """One row per configuration and batch size: rate, speedup and, for speculative rows, the bound."""
    by_key = {cfg.key: cfg for cfg in configs}
    rows: list[dict] = []
    for b in (1, BATCH):
        for cfg in configs:
            if b not in cfg.batches:
                if cfg.key == "e":
                    rows.append({"label": cfg.label, "batch": b, "na": "n/a: HF assisted generation is batch 1 only"})
                continue
            t = cfg.tallies[b]
            rate = statistics.median(t.rates)
            speedup = paired_speedup(t.rates, by_key["a"].tallies[b].rates)
            row = {"label": cfg.label, "key": cfg.key, "batch": b, "rate": rate, "speedup": speedup}
            s = t.spec_summary() if cfg.speculative else None
            if s is not None:
                c = statistics.median(t.cs) if t.cs else None
                a_geo = alpha_geo(s["mean_len"], s["k_draft"])
                row.update(alpha=s["alpha"], alpha_geo=a_geo, mean_len=s["mean_len"], k=s["k"], c=c)
                if c is not None:
                    row["bound"] = bound(a_geo, s["k"], c)
                    base = paired_speedup(t.rates, by_key["f"].tallies[1].rates) if cfg.key == "e" else speedup
                    row["ratio"] = base / row["bound"]
                    row["base_speedup"] = base
                    verify = by_key["a"].tallies[b].verify
                    if cfg.key != "e" and verify:
                        v = verify_factor(verify, s["k"] + 1)
                        row["v"] = v
                        row["bound_v"] = expected(a_geo, s["k"]) / (v + s["k"] * c)
                        row["ratio_v"] = base / row["bound_v"]
            rows.append(row)
    return rows


def main_table(rows: list[dict]) -> str:
    head = (
        "| config | batch | tok/s | speedup vs off | α | α_geo | mean accepted len | k | c | bound | measured/bound |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for row in rows:
        if "na" in row:
            lines.append(f"| {row['label']} | {row['batch']} | {row['na']} | | | | | | | | |")
            continue
        lines.append(
            f"| {row['label']} | {row['batch']} | {row['rate']:.1f} | {row['speedup']:.2f}x | "
            f"{fmt(row.get('alpha'))} | {fmt(row.get('alpha_geo'))} | {fmt(row.get('mean_len'))} | "
            f"{fmt(row.get('k'))} | {fmt(row.get('c'), '.3f')} | {fmt(row.get('bound'))} | {fmt(row.get('ratio'))} |"
        )
    return head + "\n".join(lines) + "\n"


def output_checks(configs: list[Config]) -> str:
    """Losslessness: how many greedy outputs equal (a)'s, token for token."""
    ref = next(cfg for cfg in configs if cfg.key == "a").tallies
    checks = []
    for cfg in configs:
        if cfg.key == "a":
            continue
        for b in cfg.batches:
            got, want = cfg.tallies[b].outputs, ref[b].outputs
            same = sum(1 for i in got if got[i] == want.get(i))
            checks.append(f"{cfg.key}@{b}: {same}/{len(got)}")
    a1, a8 = ref[1].outputs, ref[BATCH].outputs
    same_ab = sum(1 for i in a1 if a8.get(i) == a1[i])
    checks.append(f"a@1 vs a@{BATCH}: {same_ab}/{len(a1)}")
    return ", ".join(checks)


def report(configs: list[Config], args: argparse.Namespace, meta: dict[str, str]) -> tuple[str, list[dict]]:
    """The markdown report, and the rows it was made from."""
    rows = summarize(configs)
    off = next(cfg for cfg in configs if cfg.key == "a")
    verify_lines = [
        f"| {r['label']} | {r['batch']} | {r['k'] + 1:.2f} | {r['v']:.2f} | {r['bound_v']:.2f} | {r['speedup']:.2f}x | "
        f"{r['ratio_v']:.2f} |"
        for r in rows
        if "bound_v" in r
    ]
    verify_sizes = "; ".join(
        f"batch {b}: " + ", ".join(
            f"{n} tok {statistics.median(v[i] for v in off.tallies[b].verify):.2f}x"
            for i, n in enumerate(VERIFY_SIZES)
        )
        for b in (1, BATCH)
        if off.tallies[b].verify
    )
    g_check = ", ".join(
        f"batch {r['batch']}: {r['speedup']:.3f}x ({'within' if r['speedup'] >= 0.95 else 'NOT within'} 5%)"
        for r in rows
        if r.get("key") == "g"
    )
    policy_cs = "; ".join(
        f"{cfg.key}: " + ", ".join(f"{term} {1e3 * v:.3f} ms" for term, v in
                                   cfg.llm.engine.controller.cost.parameters().items())
        for cfg in configs
        if isinstance(cfg, SpecdConfig) and cfg.llm.engine.controller is not None
    )
    split_lines = [
        f"| {cfg.label} | {b} | {sp['steps']} | {sp['draft']:.0%} | {sp['target']:.0%} | "
        f"{sp['engine']:.0%} | {sp['outside']:.0%} |"
        for cfg in configs
        for b in cfg.batches
        if (sp := cfg.tallies[b].time_split())
    ]
    e_row = next((r for r in rows if r.get("key") == "e"), None)
    md = [
        "# specd engine benchmark (CPU)",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"- {meta['models']}",
        f"- {meta['machine']}",
        f"- greedy, {args.max_tokens} new tokens per prompt (EOS ignored), batch 1 = {meta['n_b1']} prompts "
        f"one at a time, batch {BATCH} = {BATCH} prompts in one call; median of {args.repeats} interleaved "
        "repeats after one warm-up",
        f"- fixed k = {args.k}; adaptive rows search k in 0..8; the k column is the mean drafts per decoding "
        "sequence-step",
        "",
        main_table(rows),
        "Notes:",
        "",
        "- speedup vs off: against (a) specd with speculation off at the same batch size. measured/bound: the "
        "row's speedup over its own implementation's non-speculative decoding ((a), or (f) for (e)) divided "
        "by the bound.",
        "- bound = (1 − α_geo^(k+1)) / ((1 − α_geo)(k·c + 1)). α is the engine's acceptance_rate (accepted / "
        "drafted); α_geo is the per-token acceptance of the geometric model that gives the measured mean "
        "accepted length (acceptance_rate undercounts: drafts after the first rejection are never accepted), "
        "and is what the bound uses.",
        "- c = time of one draft forward / one target forward, 1 new token per sequence at a mid-generation "
        f"context ({meta['ctx']} tokens), timed directly through the engine's ModelRunner.forward (the HF "
        "models' cached forward for (e)), interleaved, median; batch-8 rows time 8 sequences per forward. "
        "For n-gram rows the draft cost is one prompt-lookup call per sequence.",
        "- (e) and (f) are transformers `generate` at batch 1 only: HF assisted generation supports batch 1. "
        "(e) uses HF's default assistant settings (up to 20 candidates, confidence threshold 0.4); its α, "
        "mean accepted length and k come from counting target and assistant forward calls."
        + (f" Speedup of (e) over (f): {e_row['base_speedup']:.2f}x." if e_row and "base_speedup" in e_row else ""),
        f"- (g) uses an unrelated random draft model of the draft's architecture (different seed). Against (a): "
        f"{g_check}.",
        "- Speedups are medians over repeats of the per-repeat ratio to the baseline run in the same repeat; "
        "tok/s are medians of each configuration alone.",
        f"- The goodput controller's step-cost model after the run (engine.controller.cost.parameters()): "
        f"{policy_cs}.",
        f"- greedy outputs identical to (a) at the same batch size (prompts): {output_checks(configs)}. Random "
        "models have near-tied logits, so a mismatch between batch sizes or against transformers can be float "
        "rounding, not a bug; within one batch size specd should match exactly.",
        "",
        "The bound treats a target forward over k + 1 tokens as costing the same as over 1 token. On this CPU it "
        f"does not (target forward on n new tokens per sequence vs 1, measured like c: {verify_sizes}). With "
        "that cost, bound_v = E(α_geo, k) / (v(k+1) + k·c):",
        "",
        "| config | batch | k+1 | v(k+1) | bound_v | speedup vs off | measured/bound_v |",
        "|---|---|---|---|---|---|---|",
        *verify_lines,
        "",
        "Where the specd time goes (shares of wall time; engine = the step's own work outside the draft and "
        "target forwards: scheduling, verification, bookkeeping; outside = the generate loop around steps):",
        "",
        "| config | batch | steps | draft fwd | target fwd | engine | outside steps |",
        "|---|---|---|---|---|---|---|",
        *split_lines,
        "",
    ]
    return "\n".join(md), rows
