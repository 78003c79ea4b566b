"""Engine overhead on a cost-realistic pair (issue 6, item 4).

A random-weight ~300M-parameter Llama target and a small random draft (same vocabulary) are built
into a temp dir. Acceptance means nothing with random weights; what this measures is the share of
each decode step spent outside the models' own forward passes:

  model   time inside ``model(...)`` (transformers' modules, including the paged attention function
          they call per layer), target + draft, measured with forward hooks on the top-level model;
          with --compile, time inside the runners' compiled forwards (dynamo's guard checks included;
          a hook would not run inside the compiled graph)
  prep    ``ModelRunner.forward`` minus ``model``: attention metadata, input tensors, row selection,
          float32 logits copy (our per-forward preparation)
  rest    step minus ``ModelRunner.forward``: scheduling, drafter bookkeeping and draft sampling,
          verification, appending, stop checks, stats

engine share = (prep + rest) / step, over decode steps only (steps that feed no prompt tokens).
The engine's own StepStats give the coarser 1 - (target_seconds + draft_seconds) / step_seconds too.

    python benchmarks/engine_overhead.py                       # bf16, CPU, batch 1 and 32, off/draft/ngram
    python benchmarks/engine_overhead.py --profile             # plus cProfile of draft k=4 decode steps
    python benchmarks/engine_overhead.py --dtype float32 --device cuda
    python benchmarks/engine_overhead.py --dtype float32 --compile   # the issue-14 check: compiled forwards
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams  # noqa: E402
from engine.worker.compiled import CompiledForward  # noqa: E402
from engine.worker.model_runner import ModelRunner  # noqa: E402

VOCAB = 32000


def target_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816, num_hidden_layers=18,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=512,
        eos_token_id=0, bos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
    )


def draft_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1408, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
        eos_token_id=0, bos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
    )


def build(cfg: LlamaConfig, out: Path, seed: int) -> int:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval().to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    return n


@dataclass
class Timers:
    """Accumulated seconds inside model(...) and inside ModelRunner.forward, for both runners."""

    cuda: bool
    model: float = 0.0
    runner: float = 0.0
    _t0: dict[int, float] = field(default_factory=dict)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def instrument(self, runner) -> None:  # noqa: ANN001
        if runner.compiled is not None:
            self._instrument_compiled(runner.compiled)
        else:
            self._instrument_eager(runner.model)
        inner = runner.forward

        def forward(batch):  # noqa: ANN001, ANN202
            t0 = time.perf_counter()
            try:
                return inner(batch)
            finally:
                self.sync()
                self.runner += time.perf_counter() - t0

        runner.forward = forward  # instance attribute: the engine and the drafter call runner.forward

    def _instrument_compiled(self, compiled: CompiledForward) -> None:
        """Every model call of a compiled runner goes through its CompiledForward (compiled, or eager for a
        prefill or a fallback): a subclass that times __call__ (looked up on the type, so not an attribute)."""
        timers = self

        class Timed(type(compiled)):  # type: ignore[misc]
            def __call__(self, compiled: bool, **inputs):  # noqa: ANN003, ANN204
                timers.sync()
                t0 = time.perf_counter()
                try:
                    return super().__call__(compiled, **inputs)
                finally:
                    timers.sync()
                    timers.model += time.perf_counter() - t0

        compiled.__class__ = Timed

    def _instrument_eager(self, model: torch.nn.Module) -> None:
        key = id(model)

        def pre(module, args, kwargs):  # noqa: ANN001, ANN202
            self.sync()
            self._t0[key] = time.perf_counter()

        def post(module, args, kwargs, output):  # noqa: ANN001, ANN202
            self.sync()
            self.model += time.perf_counter() - self._t0[key]

        model.register_forward_pre_hook(pre, with_kwargs=True)
        model.register_forward_hook(post, with_kwargs=True)


@dataclass
class Result:
    config: str
    batch: int
    steps: int = 0
    step: float = 0.0
    model: float = 0.0
    runner: float = 0.0
    target_draft: float = 0.0  # StepStats target_seconds + draft_seconds
    tokens: int = 0
    draft_tokens: int = 0
    prefill_step: float = 0.0
    prefill_model: float = 0.0

    def row(self) -> str:
        n = max(self.steps, 1)
        prep, rest = self.runner - self.model, self.step - self.runner
        share = (prep + rest) / self.step if self.step else 0.0
        coarse = 1 - self.target_draft / self.step if self.step else 0.0
        return (
            f"| {self.config} | {self.batch} | {self.steps} | {self.draft_tokens / n / self.batch:.1f} | "
            f"{1e3 * self.step / n:.1f} | {1e3 * self.model / n:.1f} | {1e3 * prep / n:.2f} | "
            f"{1e3 * rest / n:.2f} | {100 * share:.1f}% | {100 * coarse:.1f}% | "
            f"{self.tokens / self.step:.1f} | {1e3 * self.prefill_step:.0f} ({1e3 * self.prefill_model:.0f}) |"
        )


HEADER = (
    "| config | batch | decode steps | drafts/seq/step | step ms | model ms | prep ms | rest ms | engine share "
    "| 1-(tgt+drf)/step | decode tok/s | prefill step ms (model) |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def prompts(batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, prompt_len), generator=gen).tolist()


def run_config(
    name: str, llm: LLM, timers: Timers, batch: int, args: argparse.Namespace, profile: str | None
) -> Result:
    engine = llm.engine
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts(batch, args.prompt_len, args.seed + batch)):
        engine.add_request(f"{name}-{batch}-{i}", p, params)
    res = Result(name, batch)
    prof = cProfile.Profile() if profile else None
    while engine.has_unfinished():
        m0, r0 = timers.model, timers.runner
        decode = engine.scheduler.waiting == type(engine.scheduler.waiting)() and all(
            s.is_decoding for s in engine.scheduler.running
        )
        if prof is not None and decode:
            prof.enable()
        engine.step()
        if prof is not None and decode:
            prof.disable()
        st = engine.last_step
        if st is None:
            continue
        if st.num_prompt_tokens:
            res.prefill_step += st.step_seconds
            res.prefill_model += timers.model - m0
            continue
        res.steps += 1
        res.step += st.step_seconds
        res.model += timers.model - m0
        res.runner += timers.runner - r0
        res.target_draft += st.target_seconds + st.draft_seconds
        res.tokens += st.num_generated_tokens
        res.draft_tokens += st.num_draft_tokens
    if prof is not None:
        report_profile(prof, res.steps, profile)
    return res


def report_profile(prof: cProfile.Profile, steps: int, title: str) -> None:
    """Engine-side functions (engine/*) by own time, and by cumulative time, in ms per decode step."""
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if "/engine/" in file and "/site-packages/" not in file:
            rows.append((tt, ct, nc, f"{file.split('/engine/')[-1]}:{line} {fn}"))
    print(f"\n## cProfile, {title}, {steps} decode steps (cProfile inflates Python-heavy code)")
    print("| function (engine/*) | own ms/step | cumulative ms/step | calls/step |\n|---|---|---|---|")
    for tt, ct, nc, name in sorted(rows, reverse=True)[:15]:
        print(f"| {name} | {1e3 * tt / steps:.2f} | {1e3 * ct / steps:.2f} | {nc / steps:.1f} |")
    print("\n| by cumulative (engine/*) | cumulative ms/step | own ms/step |\n|---|---|---|")
    for tt, ct, _nc, name in sorted(rows, key=lambda r: -r[1])[:15]:
        print(f"| {name} | {1e3 * ct / steps:.2f} | {1e3 * tt / steps:.2f} |")
    # torch ops called from anywhere, own time: where the host spends it
    rows = [(tt, nc, f"{fn}") for (file, line, fn), (cc, nc, tt, ct, _) in stats.stats.items()  # type: ignore[attr-defined]
            if file == "~"]
    print("\n| builtin / torch op | own ms/step | calls/step |\n|---|---|---|")
    for tt, nc, name in sorted(rows, reverse=True)[:12]:
        print(f"| {name} | {1e3 * tt / steps:.2f} | {nc / steps:.1f} |")


def draft_runners(engine: object) -> list[ModelRunner]:
    """The runners of the engine's drafters (draft model, early exit), if it drafts with any."""
    return [d.runner for d in getattr(getattr(engine, "drafting", None), "drafters", [])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--configs", default="off,draft,ngram")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = leave)")
    ap.add_argument("--profile", action="store_true", help="cProfile the draft-model decode steps")
    ap.add_argument("--compile", action="store_true",
                    help="compile the decode and verify forwards at start-up (--compile start); minutes per config")
    ap.add_argument("--workdir", default=None, help="reuse/keep the built models here")
    ap.add_argument("--out", default=None, help="write the markdown table here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    configs = args.configs.split(",")

    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="engine_overhead_")
    work = Path(args.workdir or tmp.name)  # type: ignore[union-attr]
    tdir, ddir = work / "target", work / "draft"
    sizes = {}
    for cfg, d, s in ((target_config(), tdir, args.seed), (draft_config(), ddir, args.seed + 1)):
        if (d / "config.json").exists():
            sizes[d.name] = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
        else:
            sizes[d.name] = build(cfg, d, s)
    tc, dc = target_config(), draft_config()
    desc = (
        f"target: random Llama, hidden {tc.hidden_size}, {tc.num_hidden_layers} layers, "
        f"{tc.num_attention_heads} heads, "
        f"intermediate {tc.intermediate_size}, vocab {VOCAB}, untied: {sizes['target'] / 1e6:.1f}M params\n"
        f"draft:  random Llama, hidden {dc.hidden_size}, {dc.num_hidden_layers} layers, "
        f"{dc.num_attention_heads} heads, "
        f"intermediate {dc.intermediate_size}, vocab {VOCAB}, untied: {sizes['draft'] / 1e6:.1f}M params"
    )
    print(desc)
    print(f"dtype {args.dtype}, device {args.device}, torch threads {torch.get_num_threads()}, "
          f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, greedy, ignore_eos, k={args.k}, "
          f"{'compiled' if args.compile else 'eager'} forwards")

    results = []
    for name in configs:
        kw: dict = {}
        if name == "draft":
            kw = {"draft_model": str(ddir), "speculative_method": "draft_model", "num_speculative_tokens": args.k}
        elif name == "ngram":
            kw = {"speculative_method": "ngram", "num_speculative_tokens": args.k}
        elif name != "off":
            raise SystemExit(f"unknown config {name}")
        t0 = time.perf_counter()
        llm = LLM(str(tdir), dtype=args.dtype, device=args.device, max_model_len=256, max_num_seqs=max(batches),
                  max_num_batched_tokens=max(2048, max(batches) * args.prompt_len),
                  num_kv_blocks=max(batches) * (256 // 16 + 1), compile="start" if args.compile else "off", **kw)
        timers = Timers(cuda=llm.engine.device.type == "cuda")
        timers.instrument(llm.engine.target)
        for runner in draft_runners(llm.engine):
            timers.instrument(runner)
        # warm-up: one short request (allocator, first-call paths)
        llm.generate([[5] * 8], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        print(f"[{name}] {len(draft_runners(llm.engine))} draft runner(s) timed")
        print(f"[{name}] loaded + warmed in {time.perf_counter() - t0:.1f}s", flush=True)
        for b in batches:
            prof = f"{name} batch {b}" if args.profile and name == "draft" else None
            res = run_config(name, llm, timers, b, args, prof)
            results.append(res)
            print(HEADER.splitlines()[0] if len(results) == 1 else "", end="\n" if len(results) == 1 else "")
            print(res.row(), flush=True)
        for runner in [llm.engine.target, *draft_runners(llm.engine)]:
            if runner.compiled is not None:  # a forward outside the warm-up's layouts runs eagerly: say how many
                print(f"[{name}] {runner.name}: {runner.compiled.calls} forwards compiled, "
                      f"{runner.compiled.uncompiled} decode/verify forwards uncompiled", flush=True)
        del llm

    table = HEADER + "\n" + "\n".join(r.row() for r in results)
    print("\n" + table)
    if args.out:
        cmd = "python " + " ".join(sys.argv)
        Path(args.out).write_text(f"{desc}\n\n`{cmd}`\n\n{table}\n")


if __name__ == "__main__":
    main()
