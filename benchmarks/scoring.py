#!/usr/bin/env python
"""Scoring texts as an evaluation harness does: prompt tokens scored per second, specd's server against a plain
transformers forward.

    python benchmarks/scoring.py --rounds 5      # ~6 min on 2 cores (docs/performance.md's figures)
    python benchmarks/scoring.py --rounds 1      # a quick look

specd: the embedded pair served as `make serve` would, but eager (`--compile off`), 64 held-out code prompts of
256 tokens (token ids, as lm-evaluation-harness sends them) with `echo`, `logprobs=1` and `max_tokens=0`, 8 at a
time, each client thread on its own connection. transformers: the target alone, one prompt at a time, unpadded,
its log-softmax over every position (what the server computes). Rounds alternate the two; the ratio is that of
the two medians. No bound is quoted: both do the same arithmetic, and what the server can win is how it is
done (8 prompts packed in each forward, its own attention kernel), which has no simple ceiling. Every score is
checked against the plain forward (largest difference reported). Writes benchmarks/results/scoring.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import httpx  # noqa: E402
import torch  # noqa: E402
from peer_bench.heldout import snippets  # noqa: E402
from peer_bench.systems import free_port  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

PAIR = ROOT / "models" / "default"


def prompts(n: int, tokens: int) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(PAIR / "target")
    return [tok.encode(s)[:tokens] for s in snippets(tok, n, tokens)]


def serve(port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "server", "serve", "--port", str(port), "--compile", "off", "--log-level",
           "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited; see {log}")
        time.sleep(0.5)
    raise RuntimeError("the server did not become ready")


def score_on_server(port: int, batch: list[list[int]], concurrency: int) -> tuple[float, list[list[float]]]:
    """Seconds for the whole batch, and each prompt's scores (its first token has none)."""
    clients = [httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) for _ in range(concurrency)]

    def one(i: int) -> list[float]:
        body = {"model": "specd-default", "prompt": batch[i], "echo": True, "logprobs": 1, "max_tokens": 0}
        r = clients[i % concurrency].post("/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["choices"][0]["logprobs"]["token_logprobs"][1:]

    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        scores = list(pool.map(one, range(len(batch))))
    seconds = time.perf_counter() - t
    for c in clients:
        c.close()
    return seconds, scores


@torch.inference_mode()
def score_plain(model: torch.nn.Module, batch: list[list[int]]) -> tuple[float, list[list[float]]]:
    t = time.perf_counter()
    out = []
    for ids in batch:
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [P, V]
        out.append(logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist())
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "scoring.json")
    args = ap.parse_args()
    batch = prompts(args.prompts, args.tokens)
    scored = sum(len(p) - 1 for p in batch)
    model = AutoModelForCausalLM.from_pretrained(PAIR / "target", dtype=torch.float32).eval()
    port, log = free_port(), Path("/tmp/specd-scoring.log")
    proc = serve(port, log)
    rows, worst = [], 0.0
    try:
        score_on_server(port, batch[:8], args.concurrency)  # warm-up: first-call allocations
        for rnd in range(args.rounds):
            order = ("specd", "transformers") if rnd % 2 == 0 else ("transformers", "specd")
            got: dict[str, tuple[float, list[list[float]]]] = {}
            for name in order:
                got[name] = (score_on_server(port, batch, args.concurrency) if name == "specd"
                             else score_plain(model, batch))
            for a, b in zip(got["specd"][1], got["transformers"][1]):
                worst = max(worst, max(abs(x - y) for x, y in zip(a, b)))
            row = {name: scored / got[name][0] for name in got}
            rows.append(row)
            print(f"round {rnd + 1}/{args.rounds}: specd {row['specd']:8.1f} tok/s, transformers "
                  f"{row['transformers']:8.1f} tok/s, ratio {row['specd'] / row['transformers']:.2f}", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    summary: dict = {
        "specd_tok_s": statistics.median(r["specd"] for r in rows),
        "transformers_tok_s": statistics.median(r["transformers"] for r in rows),
        "per_round_ratios": [r["specd"] / r["transformers"] for r in rows],
        "max_abs_logprob_diff": worst, "prompt_tokens_scored": scored,
    }
    summary["ratio"] = summary["specd_tok_s"] / summary["transformers_tok_s"]  # of the medians, as docs/ quote
    machine = f"{platform.machine()}, {torch.get_num_threads()} threads, cpu"
    result = {"title": f"scoring {args.prompts} prompts of {args.tokens} tokens, {args.concurrency} concurrent, "
                       f"{args.rounds} rounds, {machine}", "args": {k: str(v) for k, v in vars(args).items()},
              "summary": summary, "rounds": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n| system | prompt tokens scored / s |\n|---|---|\n"
          f"| specd, {args.concurrency} concurrent | {summary['specd_tok_s']:,.0f} |\n"
          f"| transformers forward, one at a time | {summary['transformers_tok_s']:,.0f} |\n\n"
          f"ratio {summary['ratio']:.2f}x; largest |logprob difference| "
          f"{worst:.2g}; wrote {args.out}")


if __name__ == "__main__":
    main()
