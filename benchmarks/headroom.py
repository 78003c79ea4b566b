"""How fast speculation could make the embedded pair on this host at most: the speedup bound E(a, k) / (1 + k c)
with the drafter, the host work and attention all free, and each drafted row costing only its matrix products at
the best matmul rate this host reaches. Read beside the measured speedup of a compare.py run, it says whether a
goal is out of reach for any engine at that run's acceptance, and what acceptance the goal would need.

    python benchmarks/headroom.py --runs benchmarks/results/never_lose.json \
        benchmarks/results/never_lose_more_sets.json benchmarks/results/never_lose_agentic.json

What it takes from each run, per (set, concurrency):
- a, the per-token acceptance fitted to the default's mean accepted length at its mean k (the bound's model,
  peer_bench/report.py), from the server's counters;
- p, the share of the time without speculation that speculation does not shorten: the engine's steps that fed
  prompt tokens (``specd:prefill_step_seconds`` over ``specd:engine_step_seconds``). Above one sequence such a
  step may also have decoded the others, so each request's prompt step is taken to carry one whole plain decode
  step (at most what that decode added), which errs toward a smaller p and a larger bound. A run from before that
  counter gives the clients' share instead: times to first token over concurrency x the round's seconds, median
  over rounds, which under load misses the prefill steps other sequences wait through (extraction at 8: 0.24
  against the engine's 0.35-0.47 in one run; at 1, 0.32 and 0.30). Amdahl: a decode B times faster makes the whole
  1 / (p + (1 - p) / B) times faster;
- the plain decode step's cost per sequence: the no-speculation server's step seconds, less the share p, over
  the tokens it emitted.

The floor of one more drafted row: twice the target's matrix-product weights (every linear layer and the LM head)
in FLOPs, at the faster of two measured rates: a 2048-square sgemm, and the target's own layer shapes at 512
rows (``F.linear``, float32, the run's thread count). c_floor is that over the plain decode step's cost per
sequence, and the decode's bound is the best over k = 1..16 (the server's most); with every cost at zero it is
E(a, 16). Both are given through Amdahl's p. For each goal: the least a that reaches it at the floor, and the
most a drafted row may cost at the measured a (beside what one cost the server, at concurrency 1).
A later run's (set, concurrency) replaces an earlier one's. Writes benchmarks/results/headroom.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from benchmarks.engine_bench.bound import alpha_geo, bound, expected  # noqa: E402

DEFAULT, NONE = "specd adaptive default", "specd none compiled"
K_MOST = 16  # the most drafts a sequence may get (EngineConfig's max_speculative_tokens)
# The goals issue 35 set: (set, concurrency) -> speedup over no speculation.
GOALS = {("agentic", 1): 3.0, ("agentic", 8): 2.0, ("extraction", 1): 3.0, ("extraction", 8): 2.0,
         ("code_newline", 1): 1.8}


def linear_shapes(config: object) -> list[tuple[int, int]]:
    """(in, out) of every matrix product of one token's forward: each layer's projections, then the LM head."""
    h = config.hidden_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or h // heads
    inter = config.intermediate_size
    layer = [(h, heads * d), (h, kv * d), (h, kv * d), (heads * d, h), (h, inter), (h, inter), (inter, h)]
    return layer * config.num_hidden_layers + [(h, config.vocab_size)]


def _rate(run: Callable[[], object], flops: float, repeats: int) -> float:
    """FLOP/s of ``run`` (median of ``repeats`` timed calls after two warm-up ones)."""
    for _ in range(2):
        run()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return flops / statistics.median(times)


def matmul_rates(shapes: list[tuple[int, int]], rows: int = 512, square: int = 2048, repeats: int = 7) -> dict:
    """GFLOP/s of a square sgemm and of the target's shapes at ``rows`` rows."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(square, square, generator=gen), torch.randn(square, square, generator=gen)
    weights = [torch.randn(o, i, generator=gen) for i, o in shapes]
    inputs = {i: torch.randn(rows, i, generator=gen) for i, _ in shapes}

    def layers() -> None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    with torch.inference_mode():
        sq = _rate(lambda: torch.mm(a, b), 2.0 * square**3, repeats)
        own = _rate(layers, 2.0 * rows * sum(i * o for i, o in shapes), repeats)
    return {"square_gflops": sq / 1e9, "target_shapes_gflops": own / 1e9, "rows": rows, "square": square}


def best_bound(alpha: float, c: float) -> tuple[float, int]:
    """max over k = 1..K_MOST of E(a, k) / (1 + k c), and the k that gives it."""
    return max((bound(alpha, k, c), k) for k in range(1, K_MOST + 1))


def amdahl(p: float, decode: float) -> float:
    """The whole speedup when only the share 1 - p of the time gets ``decode`` times faster."""
    return 1.0 / (p + (1.0 - p) / decode)


def alpha_needed(goal: float, c: float, p: float) -> float | None:
    """The least per-token acceptance whose bound at cost ``c`` and prefill share ``p`` reaches ``goal`` (None:
    not even a = 1)."""
    if amdahl(p, best_bound(1.0, c)[0]) < goal:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if amdahl(p, best_bound(mid, c)[0]) < goal else (lo, mid)
    return hi


def cost_allowed(goal: float, alpha: float, p: float) -> float | None:
    """The largest c (a drafted row's cost over the plain decode step's) at which acceptance ``alpha`` and prefill
    share ``p`` still reach ``goal``, all else free (None: not even at c = 0)."""
    if amdahl(p, best_bound(alpha, 0.0)[0]) < goal:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if amdahl(p, best_bound(alpha, mid)[0]) >= goal else (lo, mid)
    return lo


def row_cost_measured(cell: dict) -> float | None:
    """What a drafted token cost the server, in seconds: the summary's c (peer_bench/report.py, at concurrency 1
    only: drafting and the target's time beyond the plain forward, per drafted token, over the plain forward)."""
    c, n = cell["default"].get("c"), cell["none"]["counters"]
    if c is None or not n.get("engine_steps"):
        return None
    return c * n["target_forward_seconds"] / n["engine_steps"]


def cells(runs: list[dict]) -> dict[tuple[str, int], dict]:
    """(set, concurrency) -> the default's and no speculation's summary lines and the latter's rounds; a later
    run replaces an earlier one's."""
    out: dict[tuple[str, int], dict] = {}
    for run in runs:
        lines = {(x["set"], x["concurrency"], x["system"]): x for x in run["summary"]}
        for (name, conc, system), line in lines.items():
            none = lines.get((name, conc, NONE))
            if system == DEFAULT and none is not None:
                rounds = [r for r in run["rows"] if (r["set"], r["concurrency"], r["system"]) == (name, conc, NONE)]
                out[(name, conc)] = {"default": line, "none": none, "none_rounds": rounds}
    return out


def headroom(cell: dict, floor_per_row: float, goal: float | None) -> dict:
    d, n = cell["default"]["counters"], cell["none"]["counters"]
    conc = cell["none"]["concurrency"]
    if n.get("prefill_step_seconds") is not None:
        prefill, total, requests = n["prefill_step_seconds"], n["engine_step_seconds"], cell["none"]["requests"]
        decode_step = (total - prefill) / max(1.0, n["engine_steps"] - requests)  # a plain decode step
        beside = requests * decode_step if conc > 1 else 0.0  # others' decodes in the prompts' steps, at most
        p, source = max(0.0, prefill - beside) / total, "engine"
    else:
        p = statistics.median(sum(r["ttft_ms"]) / 1e3 / (conc * r["seconds"]) for r in cell["none_rounds"])
        source = "clients"
    drafts = d["spec_decode_num_drafts"]
    k = d["spec_decode_num_draft_tokens"] / drafts
    alpha = alpha_geo(1 + d["spec_decode_num_accepted_tokens"] / drafts, k)
    plain = n["engine_step_seconds"] * (1.0 - p) / n["generation_tokens"]  # seconds per decode sequence-step
    c = floor_per_row / plain
    decode, k_best = best_bound(alpha, c)
    return {"measured": cell["default"]["vs_none"], "alpha": alpha, "mean_k": k, "prefill_share": p,
            "prefill_share_from": source,
            "plain_ms": 1e3 * plain, "c_floor": c, "decode_bound_at_floor": decode, "k_at_floor": k_best,
            "bound_at_floor": amdahl(p, decode), "bound_all_free": amdahl(p, expected(alpha, K_MOST)),
            "goal": goal, "alpha_needed_at_floor": alpha_needed(goal, c, p) if goal else None,
            "row_ms_allowed": 1e3 * plain * allowed if (allowed := goal and cost_allowed(goal, alpha, p)) else None,
            "row_ms_measured": 1e3 * measured if (measured := row_cost_measured(cell)) else None}


def table(rows: list[dict], floor_ms: float) -> str:
    out = [f"floor of one drafted row: {floor_ms:.3f} ms (matrix products only)", "",
           "| set | conc | measured | a | p | plain ms/seq-step | c floor | bound at floor (k) | every cost 0 "
           "| goal | a the goal needs at floor | drafted row ms: the goal allows / measured |", "|" + "---|" * 12]
    for r in rows:
        need = r["alpha_needed_at_floor"]
        need_text = "-" if not r["goal"] else ("unreachable" if need is None else f"{need:.3f}")
        goal_text = f"{r['goal']:.1f}x" if r["goal"] else "-"
        rows_text = " / ".join("-" if v is None else f"{v:.3f}" for v in (r["row_ms_allowed"], r["row_ms_measured"]))
        out.append(f"| {r['set']} | {r['concurrency']} | {r['measured']:.2f}x | {r['alpha']:.3f} | "
                   f"{r['prefill_share']:.2f} | {r['plain_ms']:.2f} | {r['c_floor']:.3f} | "
                   f"{r['bound_at_floor']:.2f}x ({r['k_at_floor']}) | "
                   f"{r['bound_all_free']:.2f}x | {goal_text} | {need_text} | {rows_text} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", type=Path, required=True, help="compare.py results JSONs")
    ap.add_argument("--target", type=Path, default=REPO_ROOT / "models" / "default" / "target")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "headroom.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = linear_shapes(AutoConfig.from_pretrained(args.target))
    flops_per_row = 2.0 * sum(i * o for i, o in shapes)
    rates = matmul_rates(shapes)
    best = 1e9 * max(rates["square_gflops"], rates["target_shapes_gflops"])
    floor = flops_per_row / best
    found = cells([json.loads(p.read_text()) for p in args.runs])
    rows = [{"set": s, "concurrency": c, **headroom(cell, floor, GOALS.get((s, c)))}
            for (s, c), cell in sorted(found.items())]
    print(f"matmul rates: {rates['square_gflops']:.0f} GFLOP/s ({rates['square']}-square sgemm), "
          f"{rates['target_shapes_gflops']:.0f} GFLOP/s (the target's shapes at {rates['rows']} rows); "
          f"{flops_per_row / 1e6:.1f} MFLOP a row")
    print(table(rows, 1e3 * floor))
    result = {"machine": platform.machine(), "threads": args.threads, "torch": torch.__version__,
              "runs": [str(p) for p in args.runs], "flops_per_row": flops_per_row, "rates": rates,
              "floor_ms_per_row": 1e3 * floor, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
