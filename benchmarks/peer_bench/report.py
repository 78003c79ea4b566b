"""Summaries of the runs: the table, the speedup bound, the plots."""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path

from engine_bench.bound import alpha_geo, expected  # benchmarks/ is on sys.path

BASELINE = "specd none"
# Head-to-head ratios, specd over a peer, each round's pair measured side by side.
VERSUS = (("specd adaptive", "llama.cpp spec"), ("specd adaptive compiled", "llama.cpp spec"),
          ("specd adaptive default", "llama.cpp spec"),
          ("specd draft", "llama.cpp spec"), ("specd none", "llama.cpp none"), ("specd adaptive", "llama.cpp none"),
          ("llama.cpp spec", "llama.cpp none"))


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(rows: list[dict]) -> list[dict]:
    """One line per (prompt set, concurrency, system) from the per-round rows."""
    keys = list(dict.fromkeys((r["set"], r["concurrency"], r["system"]) for r in rows))
    out = []
    for key in keys:
        sel = [r for r in rows if (r["set"], r["concurrency"], r["system"]) == key]
        base = {r["round"]: r for r in rows if (r["set"], r["concurrency"], r["system"]) == (*key[:2], BASELINE)}
        # Ratio of medians (docs/performance.md's convention): the system's median tokens/s over rounds
        # over the baseline's; the per-round ratios stay in the JSON for inspection.
        ratios = [r["tokens_per_s"] / base[r["round"]]["tokens_per_s"] for r in sel if r["round"] in base]
        tps = statistics.median(r["tokens_per_s"] for r in sel)
        outputs = sum(r["requests"] - r["failed"] for r in sel)
        counters: dict[str, float] = {}
        for r in sel:
            for k, v in r["counters"].items():
                counters[k] = counters.get(k, 0.0) + v
        drafted = counters.get("spec_decode_num_draft_tokens", 0.0)
        line = {
            "set": key[0], "concurrency": key[1], "system": key[2], "rounds": len(sel),
            "requests": sum(r["requests"] for r in sel), "failed": sum(r["failed"] for r in sel),
            "tokens_per_s": tps,
            "loop_share": sum(r.get("loops", 0) for r in sel) / outputs if outputs else None,
            "vs_none": tps / statistics.median(b["tokens_per_s"] for b in base.values()) if base else None,
            "vs_none_per_round": ratios,
            "ttft_p50_ms": pct([x for r in sel for x in r["ttft_ms"]], 50),
            "tpot_p50_ms": pct([x for r in sel for x in r["tpot_ms"]], 50),
            "tpot_p99_ms": pct([x for r in sel for x in r["tpot_ms"]], 99),
            "acceptance": counters["spec_decode_num_accepted_tokens"] / drafted if drafted else None,
            "same_text_as_none": sum(r["same_text"] for r in sel if r["same_text"] is not None),
            "compared_texts": sum(r["requests"] for r in sel if r["same_text"] is not None),
            "differences": dict(Counter(c["kind"] for r in sel for c in r.get("differences") or ())),
            "counters": counters,
        }
        if any(r.get("hf_forwards") for r in sel):
            t = sum(r["hf_forwards"][0] for r in sel)
            line["tokens_per_target_forward"] = sum(r["output_tokens"] for r in sel) / t if t else None
        elif counters.get("engine_steps"):
            line["tokens_per_target_forward"] = counters.get("generation_tokens", 0.0) / counters["engine_steps"]
        out.append(line)
    for line in out:
        line.update(bound_for(line, out))
    return out


def bound_for(line: dict, lines: list[dict]) -> dict:
    """The speedup the math allows this speculative run over the non-speculative run of the same
    prompts and concurrency: E(alpha, k) / (1 + k c) (engine.speculative.adaptive's model), where k is the
    mean drafts per drafting step, alpha the per-token acceptance fitted to the mean accepted length at
    that k, and c = m / s with s the non-speculative run's target forward per step and m the cost of one
    draft token: drafting time per draft token plus the target's extra time for scoring it (the spec
    run's target forward time beyond s per step, per draft token). It is what an engine that spent
    nothing outside the forward passes would reach with these models, this drafter and this acceptance,
    so measured / bound is the share the engine's own work leaves. Per-step figures mix batch sizes
    above concurrency 1, so the bound is only computed at concurrency 1."""
    c = line["counters"]
    base = next((x for x in lines if (x["set"], x["concurrency"], x["system"]) ==
                 (line["set"], line["concurrency"], BASELINE)), None)
    drafts, drafted = c.get("spec_decode_num_drafts", 0.0), c.get("spec_decode_num_draft_tokens", 0.0)
    if (line["concurrency"] != 1 or not drafts or base is None or not base["counters"].get("engine_steps")
            or "target_forward_seconds" not in c):  # a peer's drafting, with no engine timings to model
        return {}
    k = drafted / drafts
    alpha = alpha_geo(1 + c["spec_decode_num_accepted_tokens"] / drafts, k)
    s = base["counters"]["target_forward_seconds"] / base["counters"]["engine_steps"]
    extra_verify = max(0.0, c["target_forward_seconds"] - c["engine_steps"] * s)
    cost = (c["draft_seconds"] + extra_verify) / drafted / s
    bound = expected(alpha, k) / (1 + k * cost)
    return {"alpha": alpha, "mean_k": k, "c": cost, "bound": bound,
            "of_bound": line["vs_none"] / bound if line["vs_none"] else None}


def versus(rows: list[dict], pairs: tuple[tuple[str, str], ...] = VERSUS) -> list[dict]:
    """Per (prompt set, concurrency) and pair (a, b) with both run: median tokens/s of each over the
    rounds both ran, their ratio (ratio of medians), and a's over b's per round for inspection."""
    out = []
    for name, conc in dict.fromkeys((r["set"], r["concurrency"]) for r in rows):
        tps = {(r["system"], r["round"]): r["tokens_per_s"]
               for r in rows if (r["set"], r["concurrency"]) == (name, conc)}
        for a, b in pairs:
            rounds = [rnd for (s, rnd) in tps if s == a and (b, rnd) in tps]
            if rounds:
                out.append({"set": name, "concurrency": conc, "a": a, "b": b, "rounds": len(rounds),
                            "a_tokens_per_s": statistics.median(tps[a, rnd] for rnd in rounds),
                            "b_tokens_per_s": statistics.median(tps[b, rnd] for rnd in rounds),
                            "ratio": (statistics.median(tps[a, rnd] for rnd in rounds)
                                      / statistics.median(tps[b, rnd] for rnd in rounds)),
                            "per_round": [tps[a, rnd] / tps[b, rnd] for rnd in rounds]})
    return out


def versus_table(lines: list[dict]) -> str:
    head = "| set | conc | system | tok/s | against | tok/s | ratio (of medians) |\n|" + "---|" * 7
    body = [f"| {x['set']} | {x['concurrency']} | {x['a']} | {x['a_tokens_per_s']:.1f} | {x['b']} "
            f"| {x['b_tokens_per_s']:.1f} | {x['ratio']:.2f} |" for x in lines]
    return head + "\n" + "\n".join(body)


def noise(rows: list[dict]) -> str:
    """How much of the machine other processes took while the runs were measured."""
    shares = sorted(r["foreign_cpu"] for r in rows if r.get("foreign_cpu") is not None)
    if not shares:
        return "Other processes' CPU share during the runs: not measured (no /proc)."
    return (f"Other processes' share of the machine's CPU time during the measured runs: median "
            f"{pct(shares, 50):.0%}, p90 {pct(shares, 90):.0%}, max {shares[-1]:.0%} ({len(shares)} runs).")


def fmt(v: object, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and v != v) else format(v, spec)


def table(lines: list[dict]) -> str:
    head = ("| set | conc | system | tok/s | loops | vs none | TTFT p50 ms | TPOT p50 ms | TPOT p99 ms "
            "| acceptance | tok/fwd | bound | of bound | same text |\n|" + "---|" * 14)
    body = []
    for x in lines:
        same = f"{x['same_text_as_none']}/{x['compared_texts']}" if x["compared_texts"] else "-"
        if x.get("differences"):
            same += " (" + ", ".join(f"{n} {kind}" for kind, n in sorted(x["differences"].items())) + ")"
        body.append(
            f"| {x['set']} | {x['concurrency']} | {x['system']} | {x['tokens_per_s']:.1f} "
            f"| {fmt(x.get('loop_share'), '.0%')} | {fmt(x['vs_none'], '.2f')} "
            f"| {fmt(x['ttft_p50_ms'], '.1f')} | {fmt(x['tpot_p50_ms'], '.2f')} | {fmt(x['tpot_p99_ms'], '.2f')} "
            f"| {fmt(x['acceptance'], '.3f')} | {fmt(x.get('tokens_per_target_forward'), '.2f')} "
            f"| {fmt(x.get('bound'), '.2f')} | {fmt(x.get('of_bound'), '.2f')} | {same} |"
            + (f" {x['failed']} failed" if x["failed"] else "")
        )
    return head + "\n" + "\n".join(body)


def plot(lines: list[dict], out_dir: Path, title: str, stem: str = "compare") -> list[Path]:
    import matplotlib  # Agg must be chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(dict.fromkeys(x["set"] for x in lines))
    systems = list(dict.fromkeys(x["system"] for x in lines))
    fig, axes = plt.subplots(1, len(sets), figsize=(6.5 * len(sets), 4.8), squeeze=False)
    for ax, name in zip(axes[0], sets, strict=True):
        for system in systems:
            mine = [x for x in lines if x["set"] == name and x["system"] == system]
            pts = sorted((x["concurrency"], x["tokens_per_s"]) for x in mine)
            if len(pts) == 1:
                ax.scatter(*zip(*pts, strict=True), label=system, marker="s")
            elif pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=system)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("generated tokens / s")
        ax.set_title(f"prompt set: {name}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    throughput = out_dir / f"{stem}_throughput.png"
    fig.savefig(throughput, dpi=110)
    plt.close(fig)

    spec = [x for x in lines if x.get("bound")]
    if not spec:
        return [throughput]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(spec)), 4.5))
    labels = [f"{x['system'].removeprefix('specd ')}\n{x['set']} c{x['concurrency']}" for x in spec]
    xs = range(len(spec))
    ax.bar([i - 0.2 for i in xs], [x["vs_none"] for x in spec], 0.4, label="measured speedup over specd none")
    ax.bar([i + 0.2 for i in xs], [x["bound"] for x in spec], 0.4, label="bound E(a,k)/(1+kc) from measured a, c")
    for i, x in zip(xs, spec, strict=True):
        ax.annotate(f"{x['of_bound']:.0%}", (i - 0.2, x["vs_none"]), ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("speedup")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    bound = out_dir / f"{stem}_bound.png"
    fig.savefig(bound, dpi=110)
    plt.close(fig)
    return [throughput, bound]
