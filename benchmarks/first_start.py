#!/usr/bin/env python
"""A first start as a user meets it: `specd serve` on the embedded pair from an empty compile cache, batch-1
requests from the moment /health answers, tokens/s per 30 s window; the default (`--compile auto`: a background
compile, seeded from the compile cache shipped with the pair) against `--compile off`, one after the other,
alternating, each from a fresh inductor cache directory.

    python benchmarks/first_start.py                      # 20 min a run, 2 pairs of runs: ~85 min
    python benchmarks/first_start.py --minutes 5 --pairs 2

Then, in each run once its forwards are final (the default: compiled; off: at once), the cold time to first
token of fresh prompts (~390 tokens each, never sent before: no prefix cache), streamed: a compiled server must
not compile at request time. `--without-shipped` adds a default run whose target is a copy of the pair without
its shipped cache (what a machine unlike the one that built it meets). Prompts: held-out code, 64 new tokens,
greedy, one persistent connection. Writes benchmarks/results/first_start.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from peer_bench.ports import free_port  # noqa: E402

PAIR = ROOT / "models" / "default"
WINDOW = 30.0


def compiled(client: httpx.Client) -> str:
    """Where the server's compile stands (off, compiling, compiled or failed), from /health."""
    return str(client.get("/health").json().get("compile", "?"))


def run(name: str, compile_mode: str, target: Path, minutes: float, prompts: list[str], fresh: list[str]) -> dict:
    port, cache = free_port(), tempfile.mkdtemp(prefix="inductor-")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "SPECD_LOG_LEVEL": "info"}
    cmd = [sys.executable, "-m", "server", "serve", "--model", str(target), "--draft-model", str(PAIR / "draft"),
           "--served-model-name", "specd-default", "--compile", compile_mode, "--port", str(port)]
    log = open(Path(cache) / "server.log", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
    try:
        t_start = time.monotonic()
        while True:
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"{name}: the server exited:\n{(Path(cache) / 'server.log').read_text()[-3000:]}")
            time.sleep(0.2)
        t0 = time.monotonic()
        requests, done_at, i = [], None, 0
        while time.monotonic() - t0 < minutes * 60:
            body = {"model": "specd-default", "prompt": prompts[i % len(prompts)], "max_tokens": 64,
                    "temperature": 0.0}
            out = client.post("/v1/completions", json=body).json()
            requests.append((time.monotonic() - t0, out["usage"]["completion_tokens"]))
            if done_at is None and compiled(client) != "compiling":
                done_at = time.monotonic() - t0
            i += 1
        ttft = [first_token(client, p) for p in fresh] if compiled(client) != "compiling" else []
        # what the server said about its compile (where it compiled, how long, what it loaded)
        said = [line.strip() for line in (Path(cache) / "server.log").read_text().splitlines()
                if "compil" in line and "layout" not in line]
        return {"name": name, "compile": compile_mode, "health_s": t0 - t_start, "compiled_at_s": done_at,
                "state": compiled(client), "requests": requests, "cold_ttft_ms": ttft, "compile_log": said}
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
        shutil.rmtree(cache, ignore_errors=True)


def first_token(client: httpx.Client, prompt: str) -> float:
    body = {"model": "specd-default", "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "stream": True}
    t = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data:") and '"text"' in line:
                return 1000 * (time.perf_counter() - t)
    raise RuntimeError("no token came back")


def windows(r: dict, minutes: float) -> list[float]:
    """Tokens/s of the requests that ended in each 30 s window (a request counted in the window it ended in)."""
    n = int(minutes * 60 // WINDOW)
    tokens = [0] * n
    for end, count in r["requests"]:
        if int(end // WINDOW) < n:
            tokens[int(end // WINDOW)] += count
    return [t / WINDOW for t in tokens]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--pairs", type=int, default=2, help="default-then-off pairs, alternating which goes first")
    ap.add_argument("--without-shipped", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/first_start.json")
    args = ap.parse_args()
    from peer_bench.heldout import snippets
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(PAIR / "target")
    prompts = snippets(tok, 8, 96)
    fresh = [p[:1600] for p in snippets(tok, 40, 390)[-6:]]
    runs = []
    order = [("default", "auto", PAIR / "target"), ("off", "off", PAIR / "target")]
    for pair in range(args.pairs):
        for name, mode, target in order if pair % 2 == 0 else order[::-1]:
            print(f"pair {pair}: {name} ...", flush=True)
            runs.append(run(name, mode, target, args.minutes, prompts, fresh))
    if args.without_shipped:
        bare = Path(tempfile.mkdtemp(prefix="target-"))
        shutil.copytree(PAIR / "target", bare / "target", ignore=shutil.ignore_patterns("compile-cache*"))
        runs.append(run("default, nothing shipped", "auto", bare / "target", args.minutes, prompts, fresh))
    per = {name: [windows(r, args.minutes) for r in runs if r["name"] == name] for name in dict.fromkeys(
        r["name"] for r in runs)}
    median = {name: [statistics.median(col) for col in zip(*w)] for name, w in per.items()}
    ratio = [d / o if o else None for d, o in zip(median["default"], median["off"])]
    print("\n| window (s) | default tok/s | off tok/s | default / off |\n|---|---|---|---|")
    for k, (d, o, q) in enumerate(zip(median["default"], median["off"], ratio)):
        print(f"| {int(k * WINDOW)}-{int((k + 1) * WINDOW)} | {d:.0f} | {o:.0f} | {q:.2f}x |" if q else
              f"| {int(k * WINDOW)}-{int((k + 1) * WINDOW)} | {d:.0f} | {o:.0f} | - |")
    for r in runs:
        print(f"{r['name']}: /health after {r['health_s']:.1f} s, compiled at {r['compiled_at_s']} s, state "
              f"{r['state']}, cold TTFT ms {[round(x) for x in r['cold_ttft_ms']]}")
    result = {"minutes": args.minutes, "window_s": WINDOW, "cpu_count": os.cpu_count(), "median_windows": median,
              "ratio": ratio, "runs": runs}
    args.out.write_text(json.dumps(result, indent=1))
    plot(median, args.out.with_suffix(".png"))
    return 0


def plot(median: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, values in median.items():
        ax.plot([WINDOW * (k + 0.5) for k in range(len(values))], values, marker="o", label=name)
    ax.set_xlabel("seconds since /health answered")
    ax.set_ylabel("tokens/s in the 30 s window (batch 1)")
    ax.set_title("first start from an empty compile cache, embedded pair, 2 cores")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
