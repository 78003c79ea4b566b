#!/usr/bin/env python
"""Generation throughput of specd on CPU, with and without speculation, against transformers.

    python benchmarks/bench_engine.py                      # builds a random target/draft pair itself
    python benchmarks/bench_engine.py --quick              # smoke test, < 60 s
    python benchmarks/bench_engine.py --target DIR --draft DIR

Rows (greedy decoding, exactly --max-tokens new tokens per prompt, EOS ignored everywhere):
  (a) specd, speculation off            (b) specd + draft model, fixed k (--k)
  (c) specd + draft model, adaptive k   (d) specd + n-gram lookup, adaptive k
  (e) transformers assisted generation  (f) transformers plain generate (the HF reference)
  (g) specd adaptive with a useless drafter (an unrelated random model): adaptive k should keep it
      within ~5% of (a).
Batch 1 runs --batch1-prompts prompts one at a time; batch 8 runs 8 prompts in one generate call
(transformers' assisted generation supports batch 1 only, so (e) and (f) are batch-1 rows).

Every configuration is warmed up once, then all configurations are interleaved within each repeat
(batch 1: per prompt, in an order rotated every prompt and repeat) and the median over --repeats is
reported, because other processes share this machine's CPU.

The bound column is the classic speculative-decoding speedup bound
    bound = E(alpha, k) / (1 + k c),   E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha),
see engine/speculative/adaptive.py. How its inputs are measured:
  * c = (one draft forward) / (one target forward), each on 1 new token per sequence at a
    mid-generation context length. For specd rows both forwards are timed directly through the
    engine's own ModelRunner.forward (paged attention and all, the path decoding takes), interleaved,
    median of many; the StepStats draft/target seconds are not used for c because a step's draft time
    covers k forwards plus the catch-up of the accepted tokens, and its target time covers k + 1
    tokens. At batch 8 the same ratio is taken with 8 sequences in each forward (the per-sequence
    costs of a batched step). For n-gram rows the "draft forward" is one prompt-lookup call
    (engine.speculative.ngram.lookup) per sequence. For the transformers row, c times the two HF models'
    forwards on 1 token with a DynamicCache.
  * alpha in the bound is alpha_geo, the per-token acceptance of the geometric model that reproduces
    the measured mean accepted length at the mean draft length of drafting steps. The engine's
    acceptance_rate (accepted / drafted, the alpha column) counts every draft after the first
    rejection as a failure, so plugging it into E() under-predicts tokens per step and the "bound"
    would not bound anything (alpha = 0.5, k = 4: E = 1.94 against a measured 2.94).
  * k in the bound is the mean number of drafts per decoding sequence-step (steps where adaptive k
    chose 0 count as 0), from the engine's StepStats.
  * measured/bound divides the measured speedup over the same implementation's non-speculative
    decoding ((a) for specd rows, (f) for the transformers row) by the bound.

Default pair, built in a temp dir with no downloads: a random Llama target (hidden 512, 8 layers,
8 heads, vocab 320 with the tests' tiny tokenizer) and a draft that is a truncated copy of it (its
first --draft-layers layers plus embeddings, final norm and lm_head). With transformers' default
init (std 0.02 everywhere) each layer adds ~10x more to the residual stream than the embedding
holds, so a truncated copy almost never agrees with the full model (alpha ~ 0 measured) and greedy
outputs collapse to one repeated token. The embedding matrix is therefore rescaled to std
--embed-std (default 3; 0 keeps the HF init), so each layer changes the stream little, as the
truncated-draft premise assumes; the measured alpha is reported whatever it is.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine_bench import BATCH  # noqa: E402
from engine_bench.configs import Config, HFConfig, SpecdConfig  # noqa: E402
from engine_bench.pair import build_pair, build_useless_draft, describe_pair, make_prompts  # noqa: E402
from engine_bench.plot import plot  # noqa: E402
from engine_bench.report import report  # noqa: E402
from engine_bench.run import benchmark  # noqa: E402

log = logging.getLogger("bench_engine")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, help="HF causal LM dir (default: build a random pair)")
    ap.add_argument("--draft", type=Path, help="HF causal LM dir sharing the target's tokenizer")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=4, help="fixed draft length of row (b)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, < 60 s: a smoke test")
    ap.add_argument("--batch1-prompts", type=int, default=4, help="prompts run one at a time in the batch-1 rows")
    ap.add_argument("--draft-layers", type=int, default=1, help="layers kept in the built truncated draft")
    ap.add_argument("--embed-std", type=float, default=3.0, help="built target's embedding std (0: HF init)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: on a shared 2-core machine, 2 OpenMP threads stall "
                         "whenever the other process holds a core, measured ~8x slower)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "engine.md")
    ap.add_argument("--plot", type=Path, default=ROOT / "benchmarks" / "results" / "bench_engine.png")
    args = ap.parse_args()
    if (args.target is None) != (args.draft is None):
        ap.error("give both --target and --draft, or neither")
    if args.quick:
        args.max_tokens = min(args.max_tokens, 24)
        args.repeats = 1
        args.batch1_prompts = min(args.batch1_prompts, 2)
    return args


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    logging.getLogger("engine").setLevel(logging.WARNING)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    workdir = Path(tempfile.mkdtemp(prefix="bench_engine_"))
    try:
        if args.target is None:
            target_dir, draft_dir = build_pair(workdir, args.quick, args.draft_layers, args.embed_std, args.seed)
            models = describe_pair(args.quick, args.draft_layers, args.embed_std, args.seed)
        else:
            target_dir, draft_dir = args.target, args.draft
            models = f"target: {target_dir}; draft: {draft_dir}"
        useless_dir = build_useless_draft(draft_dir, workdir / "useless", args.seed)
        models += "; useless drafter for (g): the draft's architecture, fresh random weights"

        vocab = AutoConfig.from_pretrained(target_dir).get_text_config().vocab_size
        prompts = make_prompts(target_dir, max(BATCH, args.batch1_prompts), vocab, max_len=64)
        max_model_len = max(len(p) for p in prompts) + args.max_tokens + 32
        ctx = int(statistics.mean(len(p) for p in prompts)) + args.max_tokens // 2

        log.info("loading the configurations (threads=%d)", args.threads)
        common = dict(model=str(target_dir), max_tokens=args.max_tokens, max_model_len=max_model_len)
        off = SpecdConfig("a", "(a) specd, speculation off", speculative_method="none", **common)
        configs: list[Config] = [
            off,
            SpecdConfig("b", f"(b) specd, draft model, k={args.k}", draft_model=str(draft_dir),
                        speculative_method="draft_model", num_speculative_tokens=args.k, **common),
            SpecdConfig("c", "(c) specd, draft model, adaptive k", draft_model=str(draft_dir),
                        speculative_method="draft_model", num_speculative_tokens=None, **common),
            SpecdConfig("d", "(d) specd, n-gram, adaptive k", speculative_method="ngram",
                        num_speculative_tokens=None, **common),
        ]
        hf_target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        hf_draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
        pad = hf_target.generation_config.pad_token_id
        pad = 0 if pad is None else pad
        configs += [
            HFConfig("e", "(e) HF assisted generate, batch 1 only", hf_target, hf_draft, args.max_tokens, pad),
            HFConfig("f", "(f) HF generate, no speculation", hf_target, None, args.max_tokens, pad),
            SpecdConfig("g", "(g) specd adaptive, useless drafter", draft_model=str(useless_dir),
                        speculative_method="draft_model", num_speculative_tokens=None, **common),
        ]
        # Context for the n-gram cost: an actual greedy output (what the lookup scans in practice).
        ngram_context = prompts[0] + off.llm.generate([prompts[0]], off.params)[0].token_ids

        benchmark(configs, prompts, args.batch1_prompts, args.repeats, ctx, args.quick, ngram_context)

        cmd = "python benchmarks/bench_engine.py " + " ".join(sys.argv[1:])
        meta = {
            "command": cmd.strip(),
            "models": models,
            "machine": (
                f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__} with {args.threads} "
                f"thread(s), transformers {transformers.__version__}, float32; "
                f"{time.strftime('%Y-%m-%d %H:%M')}, total run {time.perf_counter() - t_start:.0f}s"
            ),
            "n_b1": str(args.batch1_prompts),
            "ctx": str(ctx),
        }
        md, rows = report(configs, args, meta)
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(md)
        plot(rows, args.plot, f"specd on CPU: greedy tokens/s ({args.max_tokens} new tokens, median of "
                              f"{args.repeats})")
        print(md)
        log.info("wrote %s and %s (%.0fs)", args.results, args.plot, time.perf_counter() - t_start)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
