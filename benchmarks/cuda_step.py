"""One decode / verify step on a GPU, eager vs CUDA graphs, against the weight-read floor (issue 14).

A random bf16 Llama of Llama-3.1-8B's shape is the target and one of Llama-3.2-1B's shape the
draft (random weights: acceptance means nothing here, time per forward is the same). Each is run
through specd's ModelRunner on a paged cache, every sequence at a context of ``--context`` tokens:

  decode     the target, 1 token per sequence
  verify     the target, k + 1 tokens per sequence (k drafts and the token before them)
  draft      the draft model, 1 token per sequence (a speculative step runs it k times)

at batch 1 and 64, eagerly (transformers' modules launched from Python, per-step metadata built on
the host) and as replayed CUDA graphs in static buckets (engine.worker.graphs). Each time is the median of
``--iters`` forwards, each one synchronised (as the engine reads every step's result).

The floor of a forward is the bytes it must read, divided by the copy bandwidth measured on the same
GPU in the same run: every weight but an untied input embedding (only its rows for the step's tokens
are read), plus the K/V of every sequence's context.

    python benchmarks/cuda_step.py --out benchmarks/results/cuda_step.json
    python benchmarks/cuda_step.py --device cpu --tiny      # a seconds-long check of the script itself
    python benchmarks/cuda_step.py --plot benchmarks/results/cuda_step.json --png benchmarks/results/cuda_step.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.worker.forward_batch import ForwardBatch  # noqa: E402
from engine.worker.graphs import Buckets  # noqa: E402
from engine.worker.model_runner import ModelRunner  # noqa: E402

BLOCK = 16


def llama(hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, tied: bool) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=8192, rope_theta=500000.0,
        tie_word_embeddings=tied, eos_token_id=0, bos_token_id=1, pad_token_id=2,
    )


def shapes(tiny: bool) -> dict[str, LlamaConfig]:
    if tiny:
        return {"target": llama(256, 512, 4, 8, 2, 1000, False), "draft": llama(128, 256, 2, 4, 2, 1000, True)}
    return {
        "target": llama(4096, 14336, 32, 32, 8, 128256, False),  # Llama-3.1-8B
        "draft": llama(2048, 8192, 16, 32, 8, 128256, True),  # Llama-3.2-1B
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second a device-to-device copy moves, reads and writes counted (the memory's rate)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


def read_bytes(model: torch.nn.Module) -> int:
    """Weights one forward reads: all of them except an untied input embedding (a gather of a few rows)."""
    params = {id(p): p for p in model.parameters()}
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    if embed is not head:
        params.pop(id(embed))
    return sum(p.numel() * p.element_size() for p in params.values())


def time_forward(runner: ModelRunner, batch: ForwardBatch, iters: int) -> float:
    for _ in range(3):
        runner.forward(batch)
    sync(runner.device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        runner.forward(batch)
        sync(runner.device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def linears_alone(model: torch.nn.Module, rows: int, iters: int) -> float:
    """Seconds for every Linear of the model applied once to ``rows`` rows, captured in one CUDA graph
    on a GPU: what the matmuls cost by themselves, launches aside (the floor the library's kernels reach)."""
    device = next(model.parameters()).device
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(rows, m.in_features, dtype=m.weight.dtype, device=device) for m in linears]

    def run() -> None:
        for m, x in zip(linears, inputs):
            m(x)

    with torch.inference_mode():
        run()
        if device.type != "cuda":
            t0 = time.perf_counter()
            run()
            return time.perf_counter() - t0
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        graph.replay()
        sync(device)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            graph.replay()
            sync(device)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def profile(runner: ModelRunner, batch: ForwardBatch, label: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    runner.forward(batch)
    sync(runner.device)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            runner.forward(batch)
            sync(runner.device)
    print(f"--- profile: {label}, 5 forwards ---")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))


def batch_of(g: int, q: int, context: int, per_seq: int) -> ForwardBatch:
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(g)]
    return ForwardBatch([[3] * q] * g, [context] * g, tables, [q] * g)


def measure(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bandwidth = copy_bandwidth(device, (2 << 30) if device.type == "cuda" else (64 << 20))
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    k, batches = args.k, args.batches
    per_seq = -(-(args.context + k + 1) // BLOCK)
    rows = []
    for role, cfg in shapes(args.tiny).items():
        if role not in args.models:
            continue
        t0 = time.perf_counter()
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        runner = ModelRunner(model, role, compile=args.compile)
        runner.allocate_cache(max(batches) * per_seq, BLOCK)
        assert runner.cache is not None
        weights = read_bytes(model)
        kv_per_token = sum(s.num_kv_heads * (s.head_dim + s.v_head_dim) for s in runner.layer_shapes)
        kv_per_token *= torch.finfo(dtype).bits // 8
        buckets = Buckets.for_limits(max(batches), k, args.max_model_len, BLOCK)
        print(f"{role}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, {weights / 1e9:.2f} GB "
              f"read per forward, built in {time.perf_counter() - t0:.1f}s", flush=True)
        for g in batches:
            for q in ((1,) if role == "draft" or args.decode_only else (1, k + 1)):
                batch = batch_of(g, q, args.context, per_seq)
                runner.static = None
                eager = time_forward(runner, batch, args.iters)
                want = runner.forward(batch)
                matmuls = linears_alone(model, g * q, args.iters)
                floor_w = weights / bandwidth
                floor_kv = (weights + g * (args.context + q) * kv_per_token) / bandwidth
                for kernel in args.attention:
                    runner.use_buckets(buckets, paged_kernel=kernel == "flex")
                    assert runner.static is not None
                    bucket = runner.static.fits([q] * g, [args.context + q] * g)
                    t = time.perf_counter()
                    if runner.static.capture:
                        runner.static.capture_bucket(bucket)  # type: ignore[arg-type]
                    else:
                        runner.forward(batch)  # on CPU: the first run compiles flex_attention
                    capture = time.perf_counter() - t
                    graphs = time_forward(runner, batch, args.iters)
                    if args.profile and q == 1 + (g > 1) * k:
                        profile(runner, batch, f"{role} batch {g} x {q}, graphs, {kernel} attention")
                    got = runner.forward(batch)
                    diff = float((got - want).abs().max())
                    assert runner.static.replays > 0
                    rows.append(dict(model=role, batch=g, query=q, context=args.context, bucket=str(bucket),
                                     attention=kernel, eager_ms=eager * 1e3, graph_ms=graphs * 1e3,
                                     speedup=eager / graphs, floor_weights_ms=floor_w * 1e3,
                                     floor_weights_kv_ms=floor_kv * 1e3, graph_over_floor=graphs / floor_kv,
                                     capture_s=capture, max_abs_logit_diff=diff, linears_ms=matmuls * 1e3))
                    print(f"  {role:6s} batch {g:3d} x {q} tokens, {kernel:6s}: eager {eager * 1e3:7.2f} ms, graphs "
                          f"{graphs * 1e3:7.2f} ms ({eager / graphs:4.2f}x), floor {floor_kv * 1e3:6.2f} ms (weights "
                          f"{floor_w * 1e3:.2f}) -> graphs at {graphs / floor_kv:.2f}x floor; linears alone "
                          f"{matmuls * 1e3:.2f} ms; capture {capture:.2f}s; |logit diff| {diff:.3g}", flush=True)
        del runner, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    steps = spec_steps(rows, k) if set(args.models) == {"target", "draft"} else []
    return dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", compile=args.compile,
                torch=torch.__version__, dtype=str(dtype), bandwidth_bytes_per_s=bandwidth, k=k,
                context=args.context, iters=args.iters, rows=rows, steps=steps)


def spec_steps(rows: list[dict], k: int) -> list[dict]:
    """A decode step without speculation, and a speculative step of k draft forwards plus one verify."""
    kernel = rows[-1].get("attention", "gather")  # the last kernel measured (flex, unless only gather ran)
    at = {(r["model"], r["batch"], r["query"]): r for r in rows if r.get("attention", "gather") == kernel}
    out = []
    for g in sorted({r["batch"] for r in rows}):
        decode, verify, draft = at[("target", g, 1)], at[("target", g, k + 1)], at[("draft", g, 1)]
        for mode in ("eager", "graph"):
            out.append(dict(batch=g, mode=mode, decode_ms=decode[f"{mode}_ms"],
                            spec_step_ms=k * draft[f"{mode}_ms"] + verify[f"{mode}_ms"],
                            draft_cost_ratio=draft[f"{mode}_ms"] / decode[f"{mode}_ms"]))
    return out


def table(result: dict) -> str:
    lines = ["| model | batch x tokens | attention | eager ms | graphs ms | eager / graphs | linears alone ms | "
             "floor ms | graphs / floor |", "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        lines.append(f"| {r['model']} | {r['batch']} x {r['query']} | {r.get('attention', 'gather')} | "
                     f"{r['eager_ms']:.2f} | {r['graph_ms']:.2f} | "
                     f"{r['speedup']:.2f} | {r['linears_ms']:.2f} | {r['floor_weights_kv_ms']:.2f} | "
                     f"{r['graph_over_floor']:.2f} |")
    return "\n".join(lines)


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['model']}\n{r['batch']}x{r['query']}\n{r.get('attention', 'gather')}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(12, 4))
    ax.bar([i - 0.27 for i in x], [r["eager_ms"] for r in rows], 0.27, label="eager")
    ax.bar(list(x), [r["graph_ms"] for r in rows], 0.27, label="CUDA graphs")
    ax.bar([i + 0.27 for i in x], [r["floor_weights_kv_ms"] for r in rows], 0.27, label="read floor")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("ms per forward")
    ax.set_yscale("log")
    ax.set_title(f"{result['device']}, bf16, context {result['context']}: one forward, eager vs graphs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small shapes, to check the script on CPU")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--k", type=int, default=4, help="drafts per verify")
    p.add_argument("--context", type=int, default=500, help="tokens already in each sequence's cache")
    p.add_argument("--max-model-len", type=int, default=4096, help="sets the context buckets, as in serving")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--models", nargs="+", default=["target", "draft"], choices=["target", "draft"])
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model under the graphs (inductor's fused kernels, captured)")
    p.add_argument("--decode-only", action="store_true",
                   help="the one-token decode alone, no verify (the GPU kit: a compile of each shape takes minutes)")
    p.add_argument("--profile", action="store_true",
                   help="print the top kernels of the batch-1 decode and the batched verify graph replays")
    p.add_argument("--attention", nargs="+", default=["gather", "flex"], choices=["gather", "flex"],
                   help="the bucketed forwards' attention: a padded gather + SDPA, or FlexAttention in place")
    p.add_argument("--out", type=Path)
    p.add_argument("--plot", type=Path, help="plot a result file instead of measuring")
    p.add_argument("--png", type=Path, default=Path("benchmarks/results/cuda_step.png"))
    args = p.parse_args()
    if args.plot:
        result = json.loads(args.plot.read_text())
        plot(result, args.png)
        print(table(result))
        return
    result = measure(args)
    print(table(result))
    for s in result["steps"] if set(args.models) == {"target", "draft"} else []:
        print(f"batch {s['batch']:3d} {s['mode']:5s}: decode step {s['decode_ms']:.2f} ms, speculative step "
              f"(k={args.k}) {s['spec_step_ms']:.2f} ms, draft cost ratio c {s['draft_cost_ratio']:.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
