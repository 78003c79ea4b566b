#!/usr/bin/env python
"""How far the lookups' drafts could carry batch 1 with hindsight: what the goals at 1 can reach at all.

    python benchmarks/draft_oracle.py --sets agentic extraction code_newline [--requests 16] [--horizon 24] [--batch 8]

The default engine (hybrid, adaptive k, compiled graphs) serves each set's requests one at a time in process, as
controller_ab.py does (an agentic conversation sends its next turn from the output). At every step, beside what
the goodput controller planned, each lookup (prompt lookup, suffix decoding) is asked for up to --horizon tokens
and, for a structured request, what its grammar forces; once the request ends, each proposal is scored against
the output it produced (greedy: the target's own tokens), so the accepted length of every proposal is known.

Per set, over those steps: tokens a step emitted as planned, and with hindsight (each step the source and k in
0..k_max, or 0..--horizon, that maximise the whole run's tokens per second, Dinkelbach over the steps), each
priced by the engine's own start-up profile of the compiled target forward (the decode layout at k = 0, the
verify one past it) with everything else free. The bound is hindsight's rate over the plain step's: no choice of
these drafts, at no host cost, does better. The draft model's drafts are not replayed (it ran on few steps where
the lookups had nothing): the bound is of the lookups. At --batch N (default 8) the same requests run N at a time in
lockstep, a slot taking the next request when its own ends: each batch step feeds, with hindsight, the drafts of
its sequences' agreements that maximise the run's rate, priced by the profile at the batch's tokens and contexts,
against the plain step at that batch: what the goals at 8 can reach at all. A request's steps are the ones it took
at 1, so the bound at N is the run at 1 rearranged, not a run at N. Prints a table; writes
benchmarks/results/draft_oracle.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from transformers import AutoTokenizer  # noqa: E402

from benchmarks.controller_ab import run  # noqa: E402
from benchmarks.peer_bench.prompts import PROMPT_SETS  # noqa: E402
from engine import LLM  # noqa: E402
from engine.speculative.source import DraftRequest  # noqa: E402
from engine.speculative.step_cost import TargetCost  # noqa: E402


def agreed(proposal: list[int], output: list[int]) -> int:
    """Leading drafts of ``proposal`` that ``output`` (the tokens from the step's position on) holds."""
    return next((i for i, (a, b) in enumerate(zip(proposal, output)) if a != b), min(len(proposal), len(output)))


def best_rate(accepted: np.ndarray, seconds: np.ndarray, plain: np.ndarray) -> tuple[float, np.ndarray]:
    """The most tokens per second over all steps, each step choosing its k: ``accepted`` [N, K+1] drafts held at
    k = 0..K (the best source's at each k), ``seconds`` [N, K+1] the step at k; ``plain`` [N] the plain step.
    Dinkelbach: at rate r each step maximises tokens - r * seconds on its own; r becomes the plan's rate."""
    return dinkelbach(1.0 + accepted, seconds, float(len(plain) / plain.sum()))


def dinkelbach(tokens: np.ndarray, seconds: np.ndarray, rate: float) -> tuple[float, np.ndarray]:
    """The most tokens per second over all steps, each step choosing one column: ``tokens`` and ``seconds`` [N, C]
    (a column a step cannot take: tokens -inf), from ``rate``, a rate some choice reaches (the plain steps')."""
    pick = np.zeros(len(tokens), dtype=int)
    for _ in range(64):
        pick = np.argmax(tokens - rate * seconds, axis=1)  # [N]
        rows = np.arange(len(pick))
        new = float(tokens[rows, pick].sum() / seconds[rows, pick].sum())
        if new <= rate * (1 + 1e-12):
            break
        rate = new
    return rate, pick


def forward(cost: TargetCost, length: int, k: int) -> float:
    """The target's forward over a sequence of ``length`` tokens fed its last one and ``k`` drafts, by the
    profile: the context term is each fed token's context in thousands, as the engine observes it."""
    return cost(1.0 + k, (1 + k) * (length + k) / 1000.0, k > 0)


def hindsight(steps: list[dict], k_cap: int, cost: TargetCost) -> dict:
    """The hindsight plan of ``steps`` with at most ``k_cap`` drafts a step, against the plain step."""
    ks = np.arange(k_cap + 1)
    accepted = np.zeros((len(steps), k_cap + 1))
    seconds = np.zeros((len(steps), k_cap + 1))
    plain = np.zeros(len(steps))
    for i, s in enumerate(steps):
        held = max((min(a, k_cap) for a in s["agreed"].values()), default=0)
        accepted[i] = np.minimum(ks, held)  # a source's k drafts hold min(k, its agreed length)
        plain[i] = seconds[i, 0] = forward(cost, s["context"], 0)
        seconds[i, 1:] = [forward(cost, s["context"], int(k)) for k in ks[1:]]
    rate, pick = best_rate(accepted, seconds, plain)
    rows = np.arange(len(pick))
    return {"k_max": k_cap, "tokens_per_step": float(1.0 + accepted[rows, pick].mean()),
            "mean_k": float(ks[pick].mean()), "speedup_bound": rate / (len(plain) / plain.sum())}



def lockstep(steps: list[dict], n: int) -> list[list[dict]]:
    """``steps`` (each with its ``request``, a request's in order) as batch steps of ``n`` slots: each batch step
    holds the next step of every slot's request, and a slot whose request ended takes the next one."""
    requests: dict[int, list[dict]] = {}
    for s in steps:
        requests.setdefault(s["request"], []).append(s)
    pending = iter(requests.values())
    slots = [iter(r) for r in itertools.islice(pending, n)]
    batches = []
    while slots:
        batch, kept = [], []
        for slot in slots:
            step = next(slot, None)
            while step is None and (slot := next(pending, None)) is not None:
                slot = iter(slot)
                step = next(slot, None)
            if step is not None:
                batch.append(step)
                kept.append(slot)
        slots = kept
        if batch:
            batches.append(batch)
    return batches


def batched_hindsight(steps: list[dict], n: int, k_cap: int, cost: TargetCost) -> dict:
    """The hindsight plan of ``steps`` run ``n`` at a time (lockstep) with at most ``k_cap`` drafts a sequence, against
    the plain steps of the same batches. A draft past its sequence's agreed length only costs, so a batch step
    whose sequences would hold H drafts feeds D <= H of them, the longest agreements first (D tokens more for D
    rows more); which D, hindsight picks over the run."""
    batches = lockstep(steps, n)
    most = max(sum(min(_held(s), k_cap) for s in b) for b in batches)
    tokens = np.full((len(batches), most + 1), -np.inf)
    seconds = np.ones((len(batches), most + 1))
    emitted_plain = plain = 0.0
    for i, batch in enumerate(batches):
        held = sorted((min(_held(s), k_cap) for s in batch), reverse=True)
        contexts = [s["context"] for s in sorted(batch, key=lambda s: -min(_held(s), k_cap))]
        for d_total in range(sum(held) + 1):
            left, fed = d_total, []
            for h in held:
                fed.append(min(h, left))
                left -= fed[-1]
            context = sum((1 + d) * (c + d) for d, c in zip(fed, contexts)) / 1000.0
            tokens[i, d_total] = len(batch) + d_total
            seconds[i, d_total] = cost(len(batch) + d_total, context, d_total > 0)
        emitted_plain += len(batch)
        plain += seconds[i, 0]
    plain_rate = emitted_plain / plain
    rate, pick = dinkelbach(tokens, seconds, plain_rate)
    rows = np.arange(len(pick))
    return {"batch": n, "k_max": k_cap, "batch_steps": len(batches),
            "tokens_per_batch_step": float(tokens[rows, pick].mean()), "drafts_fed": float(pick.mean()),
            "speedup_bound": rate / plain_rate}


def _held(step: dict) -> int:
    return max(step["agreed"].values(), default=0)

def planned(steps: list[dict], cost: TargetCost) -> dict:
    """What the controller's plans emitted, priced the same way (forwards only; a draft model's own forwards
    free)."""
    tokens = seconds = plain = 0.0
    for s in steps:
        tokens += s["emitted"]
        seconds += forward(cost, s["context"], s["k"])
        plain += forward(cost, s["context"], 0)
    return {"tokens_per_step": tokens / len(steps),
            "speedup_at_forward_cost": (tokens / seconds) / (len(steps) / plain)}


def record(llm: LLM, items: list, horizon: int, decode) -> tuple[list[dict], float, int]:
    """Runs ``items`` one at a time with the plan and every proposal recorded per step; the steps, each with its
    proposals' agreed lengths once its request ended, the run's seconds and tokens."""
    drafting = llm.engine.drafting
    assert drafting is not None and drafting.controller is not None, "the default (adaptive) engine is needed"
    steps, finals, live = [], {}, []
    plan, release = drafting.plan, drafting.release

    def recording_plan(running):
        plan(running)
        for seq in running:
            if not seq.is_decoding:
                continue
            d = seq.draft
            proposals = {s.name: s.propose([DraftRequest(seq, horizon)]).tokens[0] for s in drafting.lookups}
            if d.forced:
                proposals["grammar"] = list(d.forced)
            live.append({"seq": seq, "at": len(seq.token_ids), "context": seq.num_tokens, "k": d.k,
                         "source": d.source, "proposals": proposals})

    def recording_release(seq):
        finals[id(seq)] = list(seq.token_ids)
        release(seq)

    drafting.plan, drafting.release = recording_plan, recording_release
    try:
        seconds, emitted, _ = run(llm, items, 1, decode)
    finally:
        drafting.plan, drafting.release = plan, release
    requests: dict[int, int] = {}  # id(seq) -> the request's place in the run
    for s, after in zip(live, [*live[1:], None]):  # one request at a time: its steps follow each other
        s["request"] = requests.setdefault(id(s["seq"]), len(requests))
        final = finals[id(s["seq"])]
        proposals = s.pop("proposals")
        s["proposed"] = {name: len(p) for name, p in proposals.items()}
        s["agreed"] = {name: agreed(p, final[s["at"]:]) for name, p in proposals.items()}
        # What the step emitted: up to where the request's next step began, or its end
        s["emitted"] = (after["at"] if after is not None and after["seq"] is s["seq"] else len(final)) - s["at"]
        steps.append(s)
    for s in steps:
        del s["seq"]
    return steps, seconds, emitted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=REPO_ROOT / "models" / "default")
    ap.add_argument("--sets", nargs="+", default=["agentic", "extraction", "code_newline"], choices=list(PROMPT_SETS))
    ap.add_argument("--requests", type=int, default=16, help="prompts (conversations) a set")
    ap.add_argument("--horizon", type=int, default=24, help="longest proposal asked of a lookup")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "draft_oracle.json")
    ap.add_argument("--batch", type=int, default=8, help="the bound's batch beside batch 1 (default 8)")
    ap.add_argument("--steps-out", type=Path, help="also write every recorded step here (JSON lines), per set")
    args = ap.parse_args()

    tok = AutoTokenizer.from_pretrained(args.pair / "target")
    llm = LLM(str(args.pair / "target"), draft_model=str(args.pair / "draft"), compile="background",
              compile_prompts=False)  # decode steps are what it prices: no child beside them
    controller = llm.engine.drafting.controller
    cost, k_max = controller.cost.target, controller.k_max
    results = []
    print("| set | steps | tokens/s | tokens a step, planned | at forward cost | hindsight k <= "
          f"{k_max}: tokens a step, bound | k <= {args.horizon}: tokens a step, bound | at {args.batch}, k <= {k_max}: "
          f"bound | at {args.batch}, k <= {args.horizon}: bound |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.sets:
        items = PROMPT_SETS[name](tok, args.requests + 1)
        run(llm, items[:1], 1, tok.decode)  # off the clock: a first request of the set
        steps, seconds, emitted = record(llm, items[1:], args.horizon, tok.decode)
        got = {"set": name, "steps": len(steps), "tokens_per_second": emitted / seconds,
               "planned": planned(steps, cost), "hindsight": [hindsight(steps, k_max, cost),
                                                              hindsight(steps, args.horizon, cost)],
               "batched": [batched_hindsight(steps, args.batch, k, cost) for k in (k_max, args.horizon)]}
        results.append(got)
        if args.steps_out is not None:
            with args.steps_out.open("a") as f:
                f.writelines(json.dumps({"set": name, **s}) + "\n" for s in steps)
        (h1, h2), (b1, b2) = got["hindsight"], got["batched"]
        print(f"| {name} | {len(steps)} | {got['tokens_per_second']:.0f} | {got['planned']['tokens_per_step']:.2f} | "
              f"{got['planned']['speedup_at_forward_cost']:.2f}x | {h1['tokens_per_step']:.2f}, "
              f"{h1['speedup_bound']:.2f}x | {h2['tokens_per_step']:.2f}, {h2['speedup_bound']:.2f}x | "
              f"{b1['speedup_bound']:.2f}x | {b2['speedup_bound']:.2f}x |", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"host": platform.processor() or platform.machine(), "horizon": args.horizon,
                                    "profile": controller.cost.parameters(), "sets": results}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
