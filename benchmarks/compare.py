#!/usr/bin/env python
"""specd against the peers a user would otherwise pick on the same stack, side by side.

    python benchmarks/compare.py                      # the embedded default pair, CPU: ~15 min on 2 cores
    python benchmarks/compare.py --rounds 1 --concurrency 1 4 --prompts 4   # a quick look
    python benchmarks/compare.py --target DIR --draft DIR --device cuda     # another pair, a GPU

Systems, all on one machine, started by this process (servers on 127.0.0.1, generate() in a worker):
  specd adaptive          --speculative-method hybrid (the default with a draft): per sequence per step,
                          the draft model or n-gram lookup, whichever promises more, and its k
  specd draft             the draft model alone, adaptive k
  specd none              --speculative-method none: the baseline every ratio is taken against
  specd ngram             n-gram lookup over the prompt and output, adaptive k
  transformers serve      `transformers serve`, with and without --continuous-batching
  generate assisted       transformers' generate(assistant_model=draft)
  generate prompt lookup  transformers' generate(prompt_lookup_num_tokens=10)
  llama.cpp spec          llama.cpp's llama-server with the draft model (-md; draft settings in
                          peer_bench/systems.py), on CPU; built by benchmarks/llamacpp/build.sh, the
                          pair converted to f32 GGUF on first use (benchmarks/llamacpp/convert.py).
                          One slot per request of the largest concurrency, each with the pair's context
  llama.cpp none          the same without the draft
  specd adaptive compiled specd adaptive with --compile (compiled before serving; only when named)
  specd none compiled     specd none with --compile (only when named in --systems)
  specd adaptive default  specd adaptive as the server starts with no --compile flag (on CPU in float32:
                          compiled in the background), measured once it is done (only when named)
The other specd systems run with --compile off: eager, whatever the server's default.
Every system loads the same weights in the same dtype (float32 on CPU, bfloat16 on CUDA) with the
process's default thread count (--threads for llama.cpp, whose own default is not that). Without a
llama-server binary, or on a GPU, the llama.cpp systems are left out with a message.

    python benchmarks/compare.py --sets code_newline --concurrency 1 8 32 --rounds 5 \
        --systems "specd adaptive default" "specd none compiled" "llama.cpp spec" \
        --baseline "specd none compiled" --out benchmarks/results/methods_alone.json

Workload: greedy, 128 new tokens (or until EOS, the same for everyone since greedy output is
the same), streamed completions; batch 1 (requests one after another) and concurrency 4, 16, 32
(with 2x that many requests; for agentic, that many conversations of 3 turns each, a conversation
holding its slot through its turns). generate() takes one sequence at a time, so it runs at batch 1
only, and not on extraction (it takes no response_format). Prompt sets (benchmarks/peer_bench/prompts.py
says what each looks like), by default code and edit:
  where speculation should shine: edit, agentic (each turn resends the conversation), extraction (one
    JSON schema via response_format), quoting (the continuation copies the prompt), code
  where it should lose: code_newline (prompts ending at a bare newline), prose, random (random tokens)
Rounds interleave the systems, so machine noise hits all of them alike; a ratio against specd none is
a ratio of medians: the system's median tokens/s over the rounds over specd none's (the per-round
ratios are in the JSON, vs_none_per_round). Each run also records the share of the machine's CPU
time other processes took meanwhile (from /proc); above --max-others-cpu the run is measured again
once the machine is quiet, since one busy spell skews one run alone. Each batch takes its set's next
prompts, so a server is sent a prompt again only once a set runs out (counted and printed): a suffix
index over earlier requests replays the output of a request it has seen, which no new prompt gets
(--reuse-prompts sends the same first prompts every time).

Per (set, concurrency, system): tokens/s (output tokens, recounted from the text with the target's
tokenizer, over the run's wall time), the share of outputs that are repetition loops
(peer_bench/loops.py: a looping model flatters any lookup drafter, so read a ratio with its loop
share), TTFT p50, TPOT p50/p99 ((latency - TTFT) / (tokens - 1) per request), acceptance (specd,
llama.cpp: from /metrics), tokens per target forward, whether the text equals specd none's (where not,
peer_bench/divergence.py finds the first differing token and the target's top-2 logit gap there: a
near-tie, or unexplained; the JSON keeps each such text), and for specd's speculative runs the
bound E(a,k)/(1+kc) from the measured acceptance and costs (peer_bench/report.py says how). Prints
the tables and writes the results JSON (--out, default benchmarks/results/compare.json) with two
plots beside it, named after it: OUT_throughput.png (tokens/s against concurrency) and
OUT_bound.png (measured speedup against the bound). It never writes a doc: docs/performance.md
quotes the figures it keeps and names the JSON they come from.
With llama.cpp in the run, a second table gives specd over llama.cpp (report.VERSUS).

The never-lose matrix: the server's default against no speculation on every prompt set, at 1 to 64
concurrent, 5 interleaved rounds; the same-text column checks every output against specd none's
(hours on 2 cores; run it on a quiet machine):

    python benchmarks/compare.py --systems "specd adaptive default" "specd none compiled" \
        --baseline "specd none compiled" --sets code code_newline edit agentic extraction quoting prose random \
        --concurrency 1 8 32 64 --rounds 5 --out benchmarks/results/never_lose.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402
from peer_bench import client, divergence, report  # noqa: E402
from peer_bench.loops import is_loop  # noqa: E402
from peer_bench.prompts import DEFAULT_SETS, PROMPT_SETS  # noqa: E402
from peer_bench.systems import LLAMACPP, Running, System, llamacpp_missing, llamacpp_systems, systems  # noqa: E402
from peer_bench.workload import needs_server  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

DEFAULT_PAIR = ROOT / "models" / "default"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(DEFAULT_PAIR / "target"))
    ap.add_argument("--draft", default=str(DEFAULT_PAIR / "draft"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sets", nargs="+", default=list(DEFAULT_SETS), choices=list(PROMPT_SETS),
                    help=f"prompt sets (default: {' '.join(DEFAULT_SETS)}; peer_bench/prompts.py describes each)")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16, 32])
    ap.add_argument("--prompts", type=int, default=8, help="requests at batch 1 (default 8)")
    ap.add_argument("--per-slot", type=int, default=2,
                    help="requests a round per concurrent client above batch 1 (default 2): a round ends with its "
                         "slowest client, so few a slot weigh the tail, where fewer requests are in flight")
    ap.add_argument("--reuse-prompts", action="store_true",
                    help="send every round and concurrency the same first prompts of each set (default: each batch "
                         "takes the set's next prompts, so a server sees a prompt again only once the set runs out)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--systems", nargs="+", help="a subset, by name (default: all but specd adaptive compiled)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="llama.cpp's -t (default: torch's)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "compare.json",
                    help="the results JSON; the plots are written beside it, named after it")
    ap.add_argument("--max-others-cpu", type=float, default=0.1,
                    help="measure a run again, once the machine is quiet, when other processes took more than this "
                         "share of its CPU time meanwhile (default 0.1; 1 to never)")
    ap.add_argument("--attempts", type=int, default=3, help="most measurements of one run (default 3)")
    ap.add_argument("--baseline", default=report.BASELINE,
                    help="the system every ratio and same-text check is taken against, one of those run (default: "
                         "specd none, eager; specd none compiled to compare compiled with compiled; a --variant's "
                         "name, e.g. 'specd adaptive default (--speculative-method none)': the default server as it "
                         "starts, speculation off)")
    ap.add_argument("--base-tree", type=Path,
                    help="another checkout (a git worktree of an earlier commit, say): adds 'specd adaptive default "
                         "(base)', the default server run from there, to A/B two commits on one run's prompts")
    ap.add_argument("--variant", nargs=2, action="append", default=[], metavar=("SYSTEM", "ARGS"),
                    help="adds 'SYSTEM (ARGS)': a specd system started with ARGS after its own, to A/B a server option "
                         "on one run's prompts, e.g. --variant 'specd none compiled' '--prefill-hold-steps 0' "
                         "(named in --systems or not, it runs)")
    ap.add_argument("--rejudge", type=Path, metavar="JSON",
                    help="judge a results JSON's differing texts again (with this peer_bench/divergence.py), "
                         "rewrite its summary and versus tables and exit")
    args = ap.parse_args()
    report.BASELINE = args.baseline  # read by the report's functions when they run
    if args.rejudge:
        rejudge(args.rejudge, Path(args.target))
        return

    chosen = choose_systems(args, ap)
    if not any(s.name == report.BASELINE for s in chosen):
        ap.error(f"the systems must include {report.BASELINE!r}: every ratio is taken against it")
    tok = AutoTokenizer.from_pretrained(args.target)
    sizes = [args.prompts if c == 1 else args.per_slot * c for c in args.concurrency]
    needed = max(sizes) if args.reuse_prompts else args.rounds * sum(sizes) + 1
    prompts = {name: PROMPT_SETS[name](tok, needed) for name in args.sets}
    batches = Batches(prompts, args.reuse_prompts)

    log_dir = Path(tempfile.mkdtemp(prefix="specd-compare-"))
    print(f"starting {len(chosen)} systems (logs in {log_dir})", flush=True)
    running: list[Running] = []
    rows: list[dict] = []
    t_start = time.perf_counter()
    try:
        # One after another: a server's start-up calibration (the goodput controller's step-cost profile) timed
        # beside another's compile measured decode at 16 sequences slower than at 32.
        for s in chosen:
            r = Running(s, log_dir)
            running.append(r)
            r.wait_ready()
            warm = client.run(r, prompts[args.sets[0]][-1:], 16, 1)  # first-call allocations
            if not all(x.ok for x in warm.results):
                raise RuntimeError(f"{r.system.name} failed its warm-up: {warm.results[0].error}")
        print(f"all ready in {time.perf_counter() - t_start:.0f} s", flush=True)
        for rnd in range(args.rounds):
            order = running[rnd % len(running):] + running[: rnd % len(running)]  # rotate who goes first
            for name in args.sets:
                for conc in args.concurrency:
                    batch, repeated = batches.next(name, args.prompts if conc == 1 else args.per_slot * conc)
                    for r in order:
                        if r.system.kind == "generate" and (conc > 1 or any(map(needs_server, batch))):
                            continue
                        run = client.measure(r, batch, args.max_tokens, conc, args.max_others_cpu, args.attempts)
                        rows.append(row_of(rnd, name, conc, r.system.name, run, tok, batch)
                                    | {"repeated_prompts": repeated})
                        x = rows[-1]
                        print(f"round {rnd + 1}/{args.rounds} {name:12s} c{conc:<3d} {r.system.name:24s} "
                              f"{x['tokens_per_s']:8.1f} tok/s  loops {x['loops']}/{len(x['ttft_ms'])}  "
                              f"ttft p50 {report.pct(x['ttft_ms'], 50):7.1f} ms  "
                              f"others' cpu {report.fmt(x['foreign_cpu'], '4.0%')}"
                              + (f"  {x['failed']} FAILED: {x['errors'][:1]}" if x["failed"] else ""), flush=True)
    finally:
        for r in running:
            r.stop()
    mark_same_text(rows)
    divergence.judge_rows(rows, Path(args.target))
    lines = report.summarize(rows)
    machine = (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {args.device}"
               + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""))
    title = (f"{Path(args.target).name} + {Path(args.draft).name}, greedy, {args.max_tokens} new tokens, "
             f"{args.rounds} rounds, {machine}")
    versus = report.versus(rows)
    repeats = {name: sum(r["repeated_prompts"] for r in rows if r["set"] == name and r["system"] == report.BASELINE)
               for name in args.sets}
    seen = ", ".join(f"{k} {v}" for k, v in repeats.items())
    text = (report.table(lines)
            + f"\n\nPrompts a server had been sent before in this run (its suffix index may hold them): {seen}"
            + (f"\n\n{report.versus_table(versus)}" if versus else "") + f"\n\n{report.noise(rows)}")
    print("\n" + title + "\n\n" + text)
    for r in rows:
        del r["texts"], r["prompts"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"title": title, "args": {k: str(v) for k, v in vars(args).items()},
                                    "summary": lines, "versus": versus, "rows": rows}, indent=1))
    pngs = report.plot(lines, args.out.parent, title, args.out.stem)
    print(f"\nwrote {args.out}, " + ", ".join(map(str, pngs)))


class Batches:
    """Each batch's prompts: by default the set's next ones (a suffix index over earlier requests, or a prefix
    cache, would otherwise answer a round from the last round's identical requests: the same 4 code prompts
    every round had a lookup replay whole outputs: 2.6x at batch 1 against 1.3x on prompts not seen before);
    with ``reuse``, the set's first ones every time."""

    def __init__(self, prompts: dict[str, list], reuse: bool) -> None:
        self.prompts, self.reuse = prompts, reuse
        self.cursor = dict.fromkeys(prompts, 0)
        self.sent: dict[str, set[str]] = {name: set() for name in prompts}
        for name, ps in prompts.items():
            self.sent[name].add(repr(ps[-1]))  # the warm-up request's

    def next(self, name: str, size: int) -> tuple[list, int]:
        """The batch, and how many of its prompts were sent before in this run."""
        ps = self.prompts[name]
        start = 0 if self.reuse else self.cursor[name]
        self.cursor[name] = start + size
        batch = [ps[(start + i) % len(ps)] for i in range(size)]
        keys = [repr(p) for p in batch]
        repeated = sum(k in self.sent[name] for k in keys)
        self.sent[name].update(keys)
        return batch, repeated


def choose_systems(args: argparse.Namespace, ap: argparse.ArgumentParser) -> list[System]:
    """The systems named in --systems (else the default ones), llama.cpp's when it can run here."""
    known = systems(args.target, args.draft, args.device)
    if args.base_tree is not None:
        default = next(s for s in known if s.name == "specd adaptive default")
        known.append(dataclasses.replace(default, name=f"{default.name} (base)", cwd=args.base_tree.resolve()))
    variants = []
    for name, extra in args.variant:
        base = next((s for s in known if s.name == name and s.kind == "server" and s.binary is None), None)
        if base is None:
            ap.error(f"--variant: {name!r} is not a specd server system")
        variants.append(dataclasses.replace(base, name=f"{name} ({extra})", args=(*base.args, *shlex.split(extra))))
    unknown = set(args.systems or ()) - {s.name for s in known} - set(LLAMACPP)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}; known: {[s.name for s in known] + list(LLAMACPP)}")
    if not args.systems or set(args.systems) & set(LLAMACPP):
        missing = llamacpp_missing(args.device)
        if missing:
            print(f"leaving out {', '.join(LLAMACPP)}: {missing}", flush=True)
        else:
            known += llamacpp_systems(args.target, args.draft, args.threads, max(args.concurrency))
    chosen = [s for s in known if s.name in args.systems] if args.systems else [s for s in known if s.default]
    return chosen + variants


def row_of(rnd: int, name: str, conc: int, system: str, run: client.Run, tok: object, batch: list) -> dict:
    ok = [x for x in run.results if x.ok]
    texts = [x.text if x.ok else None for x in run.results]
    ids = [tok.encode(x.text, add_special_tokens=False) for x in ok]
    counts = [len(x) for x in ids]
    row = {
        "round": rnd, "set": name, "concurrency": conc, "system": system, "requests": len(run.results),
        "failed": len(run.results) - len(ok), "errors": sorted({x.error for x in run.results if not x.ok})[:3],
        "seconds": run.seconds, "output_tokens": sum(counts), "tokens_per_s": sum(counts) / run.seconds,
        "loops": sum(map(is_loop, ids)),
        "ttft_ms": [x.ttft * 1e3 for x in ok],
        "tpot_ms": [(x.latency - x.ttft) / (n - 1) * 1e3 for x, n in zip(ok, counts, strict=True) if n > 1],
        "counters": run.counters, "texts": texts, "prompts": divergence.sent_prompts(batch, texts), "same_text": None,
        "foreign_cpu": run.foreign_cpu,
    }
    if ok and "target_forwards" in ok[0].usage:
        row["hf_forwards"] = [sum(x.usage["target_forwards"] for x in ok), sum(x.usage["draft_forwards"] for x in ok)]
    return row


def rejudge(path: Path, target: Path) -> None:
    data = json.loads(path.read_text())
    report.BASELINE = data["args"]["baseline"]
    for c in (c for r in data["rows"] for c in r.get("differences") or ()):
        if c["prompt"] is not None:  # what differences() kept, its verdict dropped
            kept = {k: c[k] for k in ("index", "prompt", "text", "baseline_text")}
            c.clear()
            c.update(kept, kind="unjudged")
    divergence.judge_rows(data["rows"], target)
    data["summary"], data["versus"] = report.summarize(data["rows"]), report.versus(data["rows"])
    path.write_text(json.dumps(data, indent=1))
    print(report.table(data["summary"]))


def mark_same_text(rows: list[dict]) -> None:
    """Greedy output must not depend on the system: count texts equal to the baseline's for the same prompt,
    and keep the ones that differ (peer_bench/divergence.py judges them)."""
    base = {(r["round"], r["set"], r["concurrency"]): r for r in rows if r["system"] == report.BASELINE}
    for r in rows:
        ref = base.get((r["round"], r["set"], r["concurrency"]))
        if ref is not None and r["system"] != report.BASELINE:
            r["same_text"] = sum(a is not None and a == b for a, b in zip(r["texts"], ref["texts"], strict=True))
            r["differences"] = divergence.differences(r["prompts"], r["texts"], ref["prompts"], ref["texts"])


if __name__ == "__main__":
    main()
