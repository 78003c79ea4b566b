"""Suffix decoding's own cost (engine.speculative.suffix), without any model: per drafted token, as the
context grows.

    python benchmarks/suffix_cost.py [--lengths 1024 4096 16384 32768] [--steps 256] [--k 8]
        [--tries c python] [--json benchmarks/results/suffix_cost.json]

Per prompt length and token stream: a request with that prompt drafts --steps times, one token appended
per step (the stream's next token, as if the target had emitted it), with the global index already
holding 100 ended outputs of 256 tokens of the same kind. Streams: "random" (uniform over a 32k vocabulary:
nothing to match, the worst case for the index's size) and "repetitive" (a 64-token phrase repeated, 5% of
its tokens replaced at random: long matches and long drafts). Reported: the one-time build of the
request's index over its prompt (us per prompt token), the mean time of one draft call (sync of the new
token into both indexes, matching and following), drafted tokens per call, and the time per drafted token
(total draft time / tokens drafted; "-" without any). Memory: bytes per node from tracemalloc, over a
random 16k stream (the C trie: the bytes it holds), and the time of a full gc.collect() without and with
those nodes alive. Each row for both tries: "c" (engine.speculative.suffix_native, what runs wherever a C
compiler is found) and "python" (engine.speculative.suffix_index, the fallback).
Single-threaded; the host's cores may be shared with other work.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
import tracemalloc
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

VOCAB = 32_000


def stream(kind: str, n: int, rnd: random.Random) -> list[int]:
    if kind == "random":
        return [rnd.randrange(VOCAB) for _ in range(n)]
    phrase = [rnd.randrange(VOCAB) for _ in range(64)]
    return [rnd.randrange(VOCAB) if rnd.random() < 0.05 else phrase[i % 64] for i in range(n)]


def run(kind: str, length: int, steps: int, k: int, trie: str) -> dict:
    from engine.speculative.source import DraftRequest
    from engine.speculative.suffix import SuffixSource
    from engine.types.sampling_params import SamplingParams
    from engine.types.sequence import Sequence

    rnd = random.Random(length)
    source = SuffixSource(max_requests=1000, max_draft=24, native=trie == "c")
    for i in range(100):  # earlier requests' outputs in the global index
        earlier = Sequence(f"old-{i}", stream(kind, 16, rnd), SamplingParams())
        earlier.token_ids.extend(stream(kind, 256, rnd))
        source.propose([DraftRequest(earlier, 0)])
        source.release(earlier)
    tokens = stream(kind, length + steps + 1, rnd)
    seq = Sequence("r", tokens[:length], SamplingParams())
    t0 = time.perf_counter()
    source.propose([DraftRequest(seq, 0)])  # builds the request's index over its prompt
    build = time.perf_counter() - t0
    drafted, seconds = 0, 0.0
    for i in range(steps):
        seq.token_ids.append(tokens[length + i])
        t0 = time.perf_counter()
        got = source.propose([DraftRequest(seq, k)]).tokens[0]
        seconds += time.perf_counter() - t0
        drafted += len(got)
    return {
        "trie": trie, "stream": kind, "prompt_tokens": length, "build_us_per_prompt_token": build / length * 1e6,
        "draft_call_us": seconds / steps * 1e6, "drafted_per_call": drafted / steps,
        "us_per_drafted_token": seconds / drafted * 1e6 if drafted else None,
        "global_nodes": source.cache.num_nodes, "request_nodes": seq.draft.suffix.index.num_nodes,  # type: ignore[union-attr]
    }


def memory(trie: str, n: int = 16_384) -> tuple[float, int, float, float]:
    """(bytes per node, nodes, seconds of a full gc.collect() without and with the index alive): what Python's
    cyclic collector must walk of the index lengthens every full collection."""
    from engine.speculative.suffix_native import new_index

    tokens = stream("random", n, random.Random(0))
    gc.collect()
    t0 = time.perf_counter()
    gc.collect()
    without = time.perf_counter() - t0
    tracemalloc.start()
    index = new_index(24, native=trie == "c")
    index.extend(index.stream(), tokens)
    used = getattr(index, "nbytes", None) or tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    t0 = time.perf_counter()
    gc.collect()
    return used / index.num_nodes, index.num_nodes, without, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--tries", nargs="+", choices=["c", "python"], default=["c", "python"])
    ap.add_argument("--json", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "suffix_cost.json")
    args = ap.parse_args()
    rows = [run(kind, n, args.steps, args.k, trie) for kind in ("random", "repetitive") for n in args.lengths
            for trie in args.tries]
    print(f"{'trie':<6} {'stream':<11} {'prompt':>6} {'build us/tok':>12} {'draft call us':>13} {'drafted/call':>12} "
          f"{'us/drafted':>10} {'request nodes':>13} {'global nodes':>12}")
    for r in rows:
        per = f"{r['us_per_drafted_token']:.1f}" if r["us_per_drafted_token"] is not None else "-"
        print(f"{r['trie']:<6} {r['stream']:<11} {r['prompt_tokens']:>6} {r['build_us_per_prompt_token']:>12.1f} "
              f"{r['draft_call_us']:>13.1f} {r['drafted_per_call']:>12.2f} {per:>10} {r['request_nodes']:>13} "
              f"{r['global_nodes']:>12}")
    mem = {}
    for trie in args.tries:
        per_node, nodes, gc_without, gc_seconds = memory(trie)
        mem[trie] = {"bytes_per_node": per_node, "gc_nodes": nodes, "gc_collect_seconds_without": gc_without,
                     "gc_collect_seconds": gc_seconds}
        print(f"memory ({trie}): {per_node:.0f} bytes per node (random 16k stream: {nodes} nodes); a full "
              f"gc.collect(): {gc_without * 1e3:.0f} ms without them, {gc_seconds * 1e3:.0f} ms with them alive")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"k": args.k, "steps": args.steps, "memory": mem, "rows": rows}, indent=2)
                         + "\n")


if __name__ == "__main__":
    main()
