"""The whole engine on a GPU with the embedded pair: CUDA graphs on vs off, speculation on vs off.

Every configuration is a fresh ``LLM`` (its start-up, graph capture included, is reported) running the
held-out code prompts of benchmarks/compare.py, greedy, ``--max-tokens`` each, EOS ignored: one
prompt at a time (batch 1) and ``--concurrency`` prompts in one call. Modes alternate within each
round; tokens/s is the median over rounds. Outputs of graphs-on and graphs-off runs are compared
token by token (bf16 on a GPU: a divergence can only come at a near-tie, and is counted, not hidden).

    python benchmarks/cuda_engine.py --out benchmarks/results/cuda_engine.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.peer_bench.prompts import code_prompts  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

PAIR = ROOT / "models" / "default"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(llm: LLM, prompts: list[str], batch: int, max_tokens: int) -> tuple[float, list[list[int]], dict[str, float]]:
    """tokens/s, the outputs, and where the decode steps' time went (summed StepStats)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine, step = llm.engine, llm.engine.step
    parts = dict(steps=0.0, step_s=0.0, target_s=0.0, draft_s=0.0, draft_tokens=0.0, accepted=0.0, decoding=0.0)

    def counted_step():  # noqa: ANN202
        out = step()
        st = engine.last_step
        if st is not None and st.num_prompt_tokens == 0:
            for key, value in (("steps", 1), ("step_s", st.step_seconds), ("target_s", st.target_seconds),
                               ("draft_s", st.draft_seconds), ("draft_tokens", st.num_draft_tokens),
                               ("accepted", st.num_accepted_tokens), ("decoding", st.num_decoding)):
                parts[key] += value
        return out

    engine.step = counted_step  # type: ignore[method-assign]
    sync()
    t0 = time.perf_counter()
    outs = []
    try:
        for i in range(0, len(prompts), batch):
            outs += [o.token_ids for o in llm.generate(prompts[i : i + batch], params)]
        sync()
    finally:
        del engine.step
    return sum(len(o) for o in outs) / (time.perf_counter() - t0), outs, parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4, help="run one at a time at batch 1")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="cuda", help="cpu runs the padded buckets eagerly: a check of the script")
    ap.add_argument("--attention", nargs="+", default=["flex", "gather"], choices=["flex", "gather"],
                    help="graphs-on runs, one per attention kernel of the bucketed forwards")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(PAIR / "target")
    prompts = code_prompts(tok, max(args.prompts, args.concurrency))
    # graphs: "" = off, else the bucketed forwards' attention kernel
    configs = [(method, graphs) for method in ("none", "hybrid") for graphs in ("", *args.attention)]
    llms, startup = {}, {}
    for method, graphs in configs:
        t0 = time.perf_counter()
        llms[method, graphs] = LLM(model=str(PAIR / "target"), draft_model=str(PAIR / "draft") if method != "none"
                                   else None, speculative_method=method, device=args.device, dtype=args.dtype,
                                   max_num_seqs=args.concurrency, cuda_graphs=bool(graphs),
                                   paged_attention=graphs or "auto")
        startup[method, graphs] = time.perf_counter() - t0
        target = llms[method, graphs].engine.target
        print(f"{method:6s} graphs {graphs or 'off':6s}: started in {startup[method, graphs]:.1f}s"
              f" ({len(target.static.graphs) if target.static else 0} target graphs)", flush=True)
    rates: dict[tuple[str, str, int], list[float]] = {}
    outputs: dict[tuple[str, str, int], list[list[int]]] = {}
    parts: dict[tuple[str, str, int], dict[str, float]] = {}
    for rnd in range(args.rounds + 1):  # round 0 warms every configuration up and is not counted
        for batch, n in ((1, args.prompts), (args.concurrency, args.concurrency)):
            for method, graphs in configs if rnd % 2 else reversed(configs):
                rate, outs, spent = run(llms[method, graphs], prompts[:n], batch, args.max_tokens)
                if rnd:
                    rates.setdefault((method, graphs, batch), []).append(rate)
                outputs[method, graphs, batch] = outs
                parts[method, graphs, batch] = spent
    rows = []
    for method, graphs in configs:
        for batch in (1, args.concurrency):
            key = (method, graphs, batch)
            off = (method, "", batch)
            same = sum(a == b for a, b in zip(outputs[key], outputs[off]))
            rate = statistics.median(rates[key])
            base = statistics.median(rates[("none", "", batch)])
            p = parts[key]
            steps = max(p["steps"], 1)
            rows.append(dict(method=method, cuda_graphs=bool(graphs), attention=graphs or None, batch=batch,
                             tokens_per_s=rate, vs_eager_none=rate / base,
                             vs_graphs_off=rate / statistics.median(rates[off]),
                             same_as_graphs_off=f"{same}/{len(outputs[key])}", startup_s=startup[method, graphs],
                             rounds=rates[key], decode_step_ms=1e3 * p["step_s"] / steps,
                             target_ms=1e3 * p["target_s"] / steps, draft_ms=1e3 * p["draft_s"] / steps,
                             drafts_per_seq_step=p["draft_tokens"] / max(p["decoding"], 1),
                             acceptance=p["accepted"] / max(p["draft_tokens"], 1)))
            r = rows[-1]
            print(f"{method:6s} graphs {graphs or 'off':6s} batch {batch:3d}: {rate:8.1f} tok/s "
                  f"({rate / base:5.2f}x eager none, {r['vs_graphs_off']:4.2f}x graphs off), "
                  f"outputs same as graphs off {same}/{len(outputs[key])}; last round's decode steps: "
                  f"{r['decode_step_ms']:.2f} ms (target {r['target_ms']:.2f}, draft {r['draft_ms']:.2f}), "
                  f"{r['drafts_per_seq_step']:.2f} drafts per sequence-step, acceptance {r['acceptance']:.2f}",
                  flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        args.out.write_text(json.dumps(dict(device=name, torch=torch.__version__,
                                            max_tokens=args.max_tokens, rows=rows), indent=1))


if __name__ == "__main__":
    main()
