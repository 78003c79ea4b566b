"""What each --compile mode gives a user from the moment the server process starts: the embedded pair's
default engine (hybrid, adaptive k) built in a fresh process per mode, then batch-1 requests one after
another until --seconds have passed since the process began.

    python benchmarks/background_compile.py [--seconds 240] [--modes off start background] [--cold]
        [--json benchmarks/results/background_compile.json]

Per mode: when the engine was ready to take a request (the start-up, compile included for start), when
the first request finished, when the compiled forwards took over (start: at ready; background: when its
thread was done), tokens served by 60 s / 120 s / the end, tokens/s while compiling (the requests that
ended then) and at the end (one pass over all the prompts after --seconds), and the slowest request's
tokens/s. 8 held-out code prompts in turn, greedy, 64 new tokens.
--cold gives every mode a fresh inductor cache directory (as on a machine's first start); otherwise all
modes read the machine's cache (warm after one run). The modes run one after another, not side by side:
each measures a process's own start, so compare the columns, not fractions of a percent.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))


def worker(mode: str, seconds: float, t0: float) -> dict:
    """One process's run; ``t0``: the parent's clock when it started this process (time.time())."""
    from peer_bench.prompts import code_prompts

    from engine import LLM, SamplingParams

    pair = REPO_ROOT / "models" / "default"
    llm = LLM(model=str(pair / "target"), draft_model=str(pair / "draft"), dtype="float32", device="cpu",
              compile=mode)
    ready = time.time() - t0
    engine = llm.engine
    compiles = engine.compile_mode.value != "off"
    compiled_at = ready if compiles and engine.compile_state != "compiling" else None
    prompts = code_prompts(llm.engine.tokenizer, 8)
    params = SamplingParams(max_tokens=64, temperature=0.0)
    requests = []  # (end, tokens, seconds, compiled when it ended)
    i = 0
    while time.time() - t0 < seconds:
        start = time.perf_counter()
        out = llm.generate([prompts[i % len(prompts)]], params)[0]
        took = time.perf_counter() - start
        state = engine.compile_state
        if compiles and compiled_at is None and state != "compiling":
            compiled_at = time.time() - t0
        requests.append((time.time() - t0, len(out.token_ids), took, state != "compiling"))
        i += 1
    # Then one pass over all 8 prompts in the state reached: the steady rate, the same prompts for every mode
    # (acceptance, and so speed, varies by prompt; the requests after a late switch would cover a few).
    start, tokens = time.perf_counter(), 0
    for prompt in prompts:
        tokens += len(llm.generate([prompt], params)[0].token_ids)
    steady = tokens / (time.perf_counter() - start)
    return dict(mode=mode, resolved=engine.compile_mode.value, ready=ready, compiled_at=compiled_at,
                state=engine.compile_state, requests=requests, steady=steady)


def summary(run: dict, seconds: float) -> dict:
    reqs = run["requests"]

    def served_by(t: float) -> int:
        return sum(n for end, n, _, _ in reqs if end <= t)

    def rate(rows: list) -> float | None:
        return sum(n for _, n, _, _ in rows) / sum(s for _, _, s, _ in rows) if rows else None

    during = [r for r in reqs if not r[3]]
    return dict(
        mode=run["mode"], ready=run["ready"], first=reqs[0][0] if reqs else None, compiled_at=run["compiled_at"],
        by_60=served_by(60), by_120=served_by(120), total=served_by(seconds), during=rate(during), after=run["steady"],
        slowest=min((n / s for _, n, s, _ in reqs), default=None),
        requests=len(reqs),
    )


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=240.0, help="per mode, from the process's start")
    p.add_argument("--modes", nargs="+", default=["off", "start", "background"])
    p.add_argument("--cold", action="store_true", help="a fresh inductor cache directory per mode")
    p.add_argument("--json", type=Path, help="write the runs and the table here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.seconds, args.t0)))
        return
    runs = []
    for mode in args.modes:
        env = dict(os.environ)
        tmp = tempfile.TemporaryDirectory(prefix="inductor-") if args.cold else None
        if tmp is not None:
            env["TORCHINDUCTOR_CACHE_DIR"] = tmp.name
        print(f"{mode}: {args.seconds:.0f} s{' (cold inductor cache)' if tmp else ''} ...", file=sys.stderr, flush=True)
        t0 = time.time()
        out = subprocess.run([sys.executable, __file__, "--worker", mode, "--seconds", str(args.seconds),
                              "--t0", str(t0)], env=env, capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        if tmp is not None:
            tmp.cleanup()
    rows = [summary(r, args.seconds) for r in runs]
    print(f"\n{'mode':<11} {'ready s':>8} {'1st done s':>10} {'compiled s':>10} {'tok by 60s':>10} {'by 120s':>8} "
          f"{'by end':>7} {'tok/s compiling':>15} {'tok/s at end':>12} {'slowest req tok/s':>17}")
    for r in rows:
        print(f"{r['mode']:<11} {r['ready']:>8.1f} {fmt(r['first'], '.1f'):>10} {fmt(r['compiled_at'], '.1f'):>10} "
              f"{r['by_60']:>10} {r['by_120']:>8} {r['total']:>7} {fmt(r['during'], '.1f'):>15} "
              f"{fmt(r['after'], '.1f'):>12} {fmt(r['slowest'], '.1f'):>17}")
    print(f"\n{args.seconds:.0f} s per mode from process start; batch 1, greedy, 64 new tokens; "
          f"{'cold' if args.cold else 'warm'} inductor cache; {os.cpu_count()} CPUs")
    if args.json:
        args.json.write_text(json.dumps(dict(seconds=args.seconds, cold=args.cold, rows=rows, runs=runs), indent=1))


if __name__ == "__main__":
    if "--worker" not in sys.argv:
        os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
