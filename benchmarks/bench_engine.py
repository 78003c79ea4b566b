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
see engine/spec/adaptive.py. How its inputs are measured:
  * c = (one draft forward) / (one target forward), each on 1 new token per sequence at a
    mid-generation context length. For specd rows both forwards are timed directly through the
    engine's own ModelRunner.forward (paged attention and all, the path decoding takes), interleaved,
    median of many; the StepStats draft/target seconds are not used for c because a step's draft time
    covers k forwards plus the catch-up of the accepted tokens, and its target time covers k + 1
    tokens. At batch 8 the same ratio is taken with 8 sequences in each forward (the per-sequence
    costs of a batched step). For n-gram rows the "draft forward" is one prompt-lookup call
    (engine.spec.ngram.lookup) per sequence. For the transformers row, c times the two HF models'
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
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine import LLM, SamplingParams, StepStats  # noqa: E402
from engine.model_runner import ForwardBatch, ModelRunner  # noqa: E402
from engine.spec.adaptive import expected_tokens  # noqa: E402
from engine.spec.ngram import lookup  # noqa: E402

log = logging.getLogger("bench_engine")

SNIPPETS = [  # tests/tiny_models.CORPUS plus more of the same kind
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nprint(os.path.join('a', 'b'))\n# héllo wörld ünïcode ✓\n",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "x = [i * i for i in range(20) if i % 2]\nprint(sum(x))\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n",
    "with open('data.txt') as f:\n    for line in f:\n        print(line.strip())\n",
]
BATCH = 8  # prompts per generate call in the batched rows


# ---- models ------------------------------------------------------------------------------------


def build_pair(workdir: Path, quick: bool, draft_layers: int, embed_std: float, seed: int) -> tuple[Path, Path]:
    """A random Llama target and a draft that is its own first ``draft_layers`` layers."""
    from tests.tiny_models import VOCAB, build_tokenizer

    tok_dir = workdir / "tokenizer"
    build_tokenizer(tok_dir)
    hidden, layers, heads, inter = (64, 4, 4, 128) if quick else (512, 8, 8, 1376)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=1024,
        eos_token_id=0,
        bos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(cfg).eval()
    if embed_std > 0:
        with torch.no_grad():
            emb = target.get_input_embeddings().weight
            emb.mul_(embed_std / emb.std())
    target_dir, draft_dir = workdir / "target", workdir / "draft"
    target.save_pretrained(target_dir)
    AutoTokenizer.from_pretrained(tok_dir).save_pretrained(target_dir)

    draft_layers = min(draft_layers, layers - 1)
    draft_cfg = LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": draft_layers})
    draft = AutoModelForCausalLM.from_config(draft_cfg).eval()
    keep = {
        name: tensor
        for name, tensor in target.state_dict().items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < draft_layers
    }
    draft.load_state_dict(keep, strict=True)  # every draft weight is the target's own
    draft.save_pretrained(draft_dir)
    AutoTokenizer.from_pretrained(tok_dir).save_pretrained(draft_dir)
    log.info(
        "built target (hidden %d, %d layers, vocab %d, embed std %s) and a %d-layer truncated draft in %s",
        hidden, layers, VOCAB, embed_std or "HF init", draft_layers, workdir,
    )
    return target_dir, draft_dir


def build_useless_draft(draft_dir: Path, out: Path, seed: int) -> Path:
    """The draft's architecture with fresh random weights (another seed): unrelated to the target."""
    cfg = AutoConfig.from_pretrained(draft_dir)
    torch.manual_seed(seed + 7919)
    AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(out)
    try:
        AutoTokenizer.from_pretrained(draft_dir).save_pretrained(out)
    except (OSError, ValueError, TypeError):
        pass  # no tokenizer: the engine then skips the vocabulary check, prompts are token ids anyway
    return out


def make_prompts(target_dir: Path, n: int, vocab: int, max_len: int) -> list[list[int]]:
    try:
        tok = AutoTokenizer.from_pretrained(target_dir)
    except (OSError, ValueError, TypeError):
        tok = None
    prompts = []
    gen = torch.Generator().manual_seed(1234)
    for i in range(n):
        ids = tok.encode(SNIPPETS[i % len(SNIPPETS)]) if tok is not None else []
        if not ids:
            ids = torch.randint(3, vocab, (24 + 3 * i,), generator=gen).tolist()
        prompts.append([t for t in ids if t < vocab][:max_len] or [1])
    return prompts


# ---- timing helpers -----------------------------------------------------------------------------


def interleaved_medians(fns: list[Callable[[], None]], reps: int) -> list[float]:
    """Median wall time of each function, calling them round-robin so load changes hit all alike."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()  # warm
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def engine_forward_fn(runner: ModelRunner, batch: int, ctx: int, block_size: int, n: int = 1) -> Callable[[], None]:
    """One forward of ``n`` new tokens per sequence (logits for all, as when verifying n - 1 drafts)
    at positions ``ctx...``, on blocks no live sequence owns (the engine's own calibration does the
    same; what it writes there is garbage by design)."""
    nb = -(-(ctx + n) // block_size)
    assert runner.cache is not None and batch * nb <= runner.cache.num_blocks, "KV cache too small"
    fb = ForwardBatch(
        token_ids=[[5] * n] * batch,
        starts=[ctx] * batch,
        block_tables=[list(range(i * nb, (i + 1) * nb)) for i in range(batch)],
        logits_rows=[n] * batch,
    )

    def fn() -> None:
        runner.forward(fb)
        runner.synchronize()

    return fn


def hf_forward_fn(model: torch.nn.Module, ctx_ids: torch.Tensor) -> Callable[[], None]:
    """One cached single-token forward at context length ctx_ids.shape[1], cache cropped back after."""
    with torch.inference_mode():
        cache = model(input_ids=ctx_ids, use_cache=True).past_key_values
    ctx = ctx_ids.shape[1]
    nxt = ctx_ids[:, -1:]

    def fn() -> None:
        with torch.inference_mode():
            model(input_ids=nxt, past_key_values=cache, use_cache=True)
        cache.crop(ctx - cache.get_seq_length())  # a negative count: drop the token just added

    return fn


def alpha_geo(mean_len: float, k: float) -> float:
    """The per-token acceptance a with E(a, k) = mean_len (E from engine.spec.adaptive), by bisection."""
    if k <= 0 or mean_len <= 1.0:
        return 0.0
    if mean_len >= k + 1 - 1e-9:
        return 1.0

    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected(mid, k) < mean_len else (lo, mid)
    return (lo + hi) / 2


def expected(alpha: float, k: float) -> float:
    """E(alpha, k) of engine.spec.adaptive.expected_tokens, for a real-valued (mean) k."""
    if float(k).is_integer():
        return expected_tokens(alpha, int(k))
    return k + 1 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def bound(alpha: float, k: float, c: float) -> float:
    return expected(alpha, k) / (1.0 + k * c)


# ---- configurations -----------------------------------------------------------------------------


@dataclass
class Tally:
    """What one configuration did at one batch size, over the measured (not warm-up) runs."""

    rates: list[float] = field(default_factory=list)  # tokens/s, one per repeat
    tokens: int = 0
    seconds: float = 0.0
    steps: list[StepStats] = field(default_factory=list)
    hf_target_calls: int = 0
    hf_draft_calls: int = 0
    outputs: dict[int, list[int]] = field(default_factory=dict)  # prompt index -> tokens (batch 1)
    cs: list[float] = field(default_factory=list)  # c measured once per repeat
    verify: list[list[float]] = field(default_factory=list)  # per repeat: T(n tokens) / T(1), n in VERIFY_SIZES
    last_outputs: list[list[int]] = field(default_factory=list)  # the latest call's generated tokens

    def spec_summary(self) -> dict[str, float] | None:
        if self.steps:
            drafts = sum(s.num_drafts for s in self.steps)
            draft_tokens = sum(s.num_draft_tokens for s in self.steps)
            accepted = sum(s.num_accepted_tokens for s in self.steps)
            decoding = 0
            for s in self.steps:
                if s.num_draft_tokens and s.mean_k > 0:
                    decoding += round(s.num_draft_tokens / s.mean_k)
                elif s.num_prompt_tokens == 0:
                    decoding += s.num_scheduled
            if not draft_tokens:
                return {"alpha": 0.0, "mean_len": 1.0, "k_draft": 0.0, "k": 0.0}
            return {
                "alpha": accepted / draft_tokens,
                "mean_len": 1.0 + accepted / drafts,
                "k_draft": draft_tokens / drafts,
                "k": draft_tokens / max(decoding, 1),
            }
        if self.hf_target_calls:
            # transformers assisted generation: one target forward per iteration (the first one
            # includes the prompt), one assistant forward per candidate token.
            steps, drafts = self.hf_target_calls, self.hf_draft_calls
            accepted = self.tokens - steps
            return {
                "alpha": accepted / drafts if drafts else 0.0,
                "mean_len": self.tokens / steps,
                "k_draft": drafts / steps,
                "k": drafts / steps,
            }
        return None

    def time_split(self) -> dict[str, float] | None:
        if not self.steps or not self.seconds:
            return None
        draft = sum(s.draft_seconds for s in self.steps)
        target = sum(s.target_seconds for s in self.steps)
        step = sum(s.step_seconds for s in self.steps)
        return {
            "draft": draft / self.seconds,
            "target": target / self.seconds,
            "engine": (step - draft - target) / self.seconds,
            "outside": (self.seconds - step) / self.seconds,
            "steps": len(self.steps),
        }


class Config:
    key: str
    label: str
    batches: tuple[int, ...] = (1, BATCH)
    speculative: bool = True

    def __init__(self) -> None:
        self.tallies: dict[int, Tally] = {b: Tally() for b in self.batches}

    def run(self, prompts: list[list[int]], tally: Tally | None) -> int:
        """Generate for ``prompts`` in one call; record into ``tally`` unless warming up. Returns tokens."""
        raise NotImplementedError

    def measure_c(self, batch: int, ctx: int) -> float | None:
        return None


class SpecdConfig(Config):
    def __init__(self, key: str, label: str, max_tokens: int, max_model_len: int, **llm_kwargs: object) -> None:
        self.key, self.label = key, label
        self.speculative = llm_kwargs.get("speculative_method") != "none"
        super().__init__()
        self.llm = LLM(
            dtype="float32", device="cpu", max_num_seqs=BATCH, max_model_len=max_model_len, **llm_kwargs
        )  # type: ignore[arg-type]
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine = self.llm.engine
        self._recording: Tally | None = None
        original_step = engine.step

        def recording_step() -> list:
            before = engine.last_step
            out = original_step()
            if self._recording is not None and engine.last_step is not before:
                self._recording.steps.append(engine.last_step)
            return out

        engine.step = recording_step  # type: ignore[method-assign]
        if engine.policy is not None:
            log.info("%s: engine's calibrated adaptive c at batch 1 = %.3f", key, engine.policy.cost_ratio(1))

    def run(self, prompts: list[list[int]], tally: Tally | None) -> int:
        self._recording = tally
        try:
            outs = self.llm.generate(prompts, self.params)
        finally:
            self._recording = None
        if tally is not None:
            tally.last_outputs = [list(o.token_ids) for o in outs]
        return sum(len(o.token_ids) for o in outs)

    def measure_c(self, batch: int, ctx: int) -> float | None:
        engine = self.llm.engine
        drafter = engine.drafter
        if drafter is None:
            return None
        bs = engine.config.block_size
        reps = 8 if QUICK else 25
        target_fn = engine_forward_fn(engine.target, batch, ctx, bs)
        runner = getattr(drafter, "runner", None)
        if isinstance(runner, ModelRunner):
            draft_fn = engine_forward_fn(runner, batch, ctx, bs)
        else:  # n-gram: one lookup per sequence over a realistic (repetitive) token list
            n_max, n_min, k_max = engine.config.ngram_max, engine.config.ngram_min, engine.config.k_max
            toks = (NGRAM_CONTEXT * (ctx // max(len(NGRAM_CONTEXT), 1) + 1))[:ctx] or [1, 2, 3]

            def draft_fn() -> None:
                for _ in range(batch):
                    lookup(toks, n_max, n_min, k_max)

        t_target, t_draft = interleaved_medians([target_fn, draft_fn], reps)
        return t_draft / t_target

    def measure_verify(self, batch: int, ctx: int, sizes: tuple[int, ...]) -> list[float]:
        """Target forward time with n new tokens per sequence over that with 1, for each n in sizes."""
        engine = self.llm.engine
        fns = [engine_forward_fn(engine.target, batch, ctx, engine.config.block_size, n) for n in (1, *sizes)]
        times = interleaved_medians(fns, 6 if QUICK else 15)
        return [t / times[0] for t in times[1:]]


class HFConfig(Config):
    batches = (1,)

    def __init__(self, key: str, label: str, target: torch.nn.Module, draft: torch.nn.Module | None,
                 max_tokens: int, pad_id: int) -> None:
        self.key, self.label = key, label
        self.speculative = draft is not None
        super().__init__()
        self.target, self.draft = target, draft
        self.gen_config = GenerationConfig(
            max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=pad_id
        )
        self._counts = [0, 0]
        self._counting = False

        def count(i: int) -> Callable:
            def hook(module: torch.nn.Module, args: object, output: object) -> None:
                if self._counting:
                    self._counts[i] += 1
            return hook

        target.register_forward_hook(count(0))
        if draft is not None:
            draft.register_forward_hook(count(1))

    def run(self, prompts: list[list[int]], tally: Tally | None) -> int:
        assert len(prompts) == 1, "transformers' assisted generation is batch 1 only"
        ids = torch.tensor(prompts, dtype=torch.long)
        self._counts[:] = [0, 0]
        self._counting = True
        try:
            with torch.inference_mode():
                out = self.target.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    generation_config=self.gen_config,
                    assistant_model=self.draft,
                )
        finally:
            self._counting = False
        new = out[0, ids.shape[1]:].tolist()
        if tally is not None:
            tally.last_outputs = [new]
            if self.draft is not None:
                tally.hf_target_calls += self._counts[0]
                tally.hf_draft_calls += self._counts[1]
        return len(new)

    def measure_c(self, batch: int, ctx: int) -> float | None:
        if self.draft is None:
            return None
        ids = torch.randint(3, 300, (1, ctx), generator=torch.Generator().manual_seed(0))
        ids = ids.clamp(max=self.target.config.get_text_config().vocab_size - 1)
        t_target, t_draft = interleaved_medians(
            [hf_forward_fn(self.target, ids), hf_forward_fn(self.draft, ids)], 8 if QUICK else 25
        )
        return t_draft / t_target


QUICK = False
VERIFY_SIZES = (2, 3, 5, 9)  # new tokens per sequence in a verify forward (k + 1)
NGRAM_CONTEXT: list[int] = []


# ---- the run ------------------------------------------------------------------------------------


def timed(cfg: Config, prompts: list[list[int]], batch: int, idx: list[int]) -> tuple[int, float]:
    tally = cfg.tallies[batch]
    t0 = time.perf_counter()
    n = cfg.run(prompts, tally)
    dt = time.perf_counter() - t0
    tally.tokens += n
    tally.seconds += dt
    for i, toks in zip(idx, tally.last_outputs, strict=True):
        tally.outputs[i] = toks
    return n, dt


def benchmark(configs: list[Config], prompts: list[list[int]], n_b1: int, repeats: int, ctx: int) -> None:
    log.info("warm-up: every configuration once at each batch size")
    for cfg in configs:
        for b in cfg.batches:
            cfg.run(prompts[:1] if b == 1 else prompts[:BATCH], None)
    for r in range(repeats):
        t_rep = time.perf_counter()
        # c first, interleaved target/draft forwards inside each measurement.
        for cfg in configs:
            if cfg.speculative:
                for b in cfg.batches:
                    c = cfg.measure_c(b, ctx)
                    if c is not None:
                        cfg.tallies[b].cs.append(c)
            if isinstance(cfg, SpecdConfig) and cfg.key == "a":
                for b in cfg.batches:
                    cfg.tallies[b].verify.append(cfg.measure_verify(b, ctx, VERIFY_SIZES))
        per_rep = {(cfg.key, b): [0, 0.0] for cfg in configs for b in cfg.batches}
        for p in range(n_b1):
            shift = (r * n_b1 + p) % len(configs)
            for cfg in configs[shift:] + configs[:shift]:
                n, dt = timed(cfg, [prompts[p]], 1, [p])
                per_rep[(cfg.key, 1)][0] += n
                per_rep[(cfg.key, 1)][1] += dt
        b8 = [cfg for cfg in configs if BATCH in cfg.batches]
        shift = r % len(b8)
        for cfg in b8[shift:] + b8[:shift]:
            n, dt = timed(cfg, prompts[:BATCH], BATCH, list(range(BATCH)))
            per_rep[(cfg.key, BATCH)][0] += n
            per_rep[(cfg.key, BATCH)][1] += dt
        for cfg in configs:
            for b in cfg.batches:
                n, dt = per_rep[(cfg.key, b)]
                cfg.tallies[b].rates.append(n / dt)
        log.info(
            "repeat %d/%d done in %.0fs: %s", r + 1, repeats, time.perf_counter() - t_rep,
            ", ".join(f"{k}@{b} {n / dt:.1f} tok/s" for (k, b), (n, dt) in per_rep.items()),
        )


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def paired_speedup(rates: list[float], base: list[float]) -> float:
    """Median over repeats of the per-repeat ratio: both were measured interleaved in the same repeat,
    so the ratio cancels the load the repeat ran under (medians of each alone need not pair up)."""
    return statistics.median(r / b for r, b in zip(rates, base, strict=True))


def verify_factor(ratios: list[list[float]], tokens: float) -> float:
    """T(target forward on ``tokens`` new tokens per sequence) / T(on 1), interpolated linearly
    between the measured sizes (median over repeats)."""
    xs = [1.0, *map(float, VERIFY_SIZES)]
    ys = [1.0, *(statistics.median(r[i] for r in ratios) for i in range(len(VERIFY_SIZES)))]
    tokens = min(max(tokens, xs[0]), xs[-1])
    for i in range(1, len(xs)):
        if tokens <= xs[i]:
            return ys[i - 1] + (ys[i] - ys[i - 1]) * (tokens - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[-1]


def report(configs: list[Config], args: argparse.Namespace, meta: dict[str, str]) -> tuple[str, list[dict]]:
    by_key = {cfg.key: cfg for cfg in configs}
    rows: list[dict] = []
    for b in (1, BATCH):
        for cfg in configs:
            if b not in cfg.batches:
                if cfg.key == "e":
                    rows.append({"label": cfg.label, "batch": b, "na": "n/a: HF assisted generation is batch 1 only"})
                continue
            t = cfg.tallies[b]
            rate = statistics.median(t.rates)
            speedup = paired_speedup(t.rates, by_key["a"].tallies[b].rates)
            row = {"label": cfg.label, "key": cfg.key, "batch": b, "rate": rate, "speedup": speedup}
            s = t.spec_summary() if cfg.speculative else None
            if s is not None:
                c = statistics.median(t.cs) if t.cs else None
                a_geo = alpha_geo(s["mean_len"], s["k_draft"])
                row.update(alpha=s["alpha"], alpha_geo=a_geo, mean_len=s["mean_len"], k=s["k"], c=c)
                if c is not None:
                    row["bound"] = bound(a_geo, s["k"], c)
                    base = paired_speedup(t.rates, by_key["f"].tallies[1].rates) if cfg.key == "e" else speedup
                    row["ratio"] = base / row["bound"]
                    row["base_speedup"] = base
                    verify = by_key["a"].tallies[b].verify
                    if cfg.key != "e" and verify:
                        v = verify_factor(verify, s["k"] + 1)
                        row["v"] = v
                        row["bound_v"] = expected(a_geo, s["k"]) / (v + s["k"] * c)
                        row["ratio_v"] = base / row["bound_v"]
            rows.append(row)

    head = (
        "| config | batch | tok/s | speedup vs off | α | α_geo | mean accepted len | k | c | bound | measured/bound |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for row in rows:
        if "na" in row:
            lines.append(f"| {row['label']} | {row['batch']} | {row['na']} | | | | | | | | |")
            continue
        lines.append(
            f"| {row['label']} | {row['batch']} | {row['rate']:.1f} | {row['speedup']:.2f}x | "
            f"{fmt(row.get('alpha'))} | {fmt(row.get('alpha_geo'))} | {fmt(row.get('mean_len'))} | "
            f"{fmt(row.get('k'))} | {fmt(row.get('c'), '.3f')} | {fmt(row.get('bound'))} | {fmt(row.get('ratio'))} |"
        )
    table = head + "\n".join(lines) + "\n"

    # Losslessness check: greedy outputs should equal (a)'s, token for token.
    ref = by_key["a"].tallies
    checks = []
    for cfg in configs:
        if cfg.key == "a":
            continue
        for b in cfg.batches:
            got, want = cfg.tallies[b].outputs, ref[b].outputs
            same = sum(1 for i in got if got[i] == want.get(i))
            checks.append(f"{cfg.key}@{b}: {same}/{len(got)}")
    a1, a8 = ref[1].outputs, ref[BATCH].outputs
    same_ab = sum(1 for i in a1 if a8.get(i) == a1[i])
    checks.append(f"a@1 vs a@{BATCH}: {same_ab}/{len(a1)}")

    verify_lines = [
        f"| {r['label']} | {r['batch']} | {r['k'] + 1:.2f} | {r['v']:.2f} | {r['bound_v']:.2f} | {r['speedup']:.2f}x | "
        f"{r['ratio_v']:.2f} |"
        for r in rows
        if "bound_v" in r
    ]
    verify_sizes = "; ".join(
        f"batch {b}: " + ", ".join(
            f"{n} tok {statistics.median(v[i] for v in by_key['a'].tallies[b].verify):.2f}x"
            for i, n in enumerate(VERIFY_SIZES)
        )
        for b in (1, BATCH)
        if by_key["a"].tallies[b].verify
    )
    g_rows = [r for r in rows if r.get("key") == "g"]
    g_check = ", ".join(
        f"batch {r['batch']}: {r['speedup']:.3f}x ({'within' if r['speedup'] >= 0.95 else 'NOT within'} 5%)"
        for r in g_rows
    )
    policy_cs = "; ".join(
        f"{cfg.key}: {cfg.llm.engine.policy.cost_ratio(1):.3f} at batch 1, "
        f"{cfg.llm.engine.policy.cost_ratio(BATCH):.3f} at batch {BATCH}"
        for cfg in configs
        if isinstance(cfg, SpecdConfig) and cfg.llm.engine.policy is not None
    )

    split_lines = []
    for cfg in configs:
        for b in cfg.batches:
            sp = cfg.tallies[b].time_split()
            if sp:
                split_lines.append(
                    f"| {cfg.label} | {b} | {sp['steps']} | {sp['draft']:.0%} | {sp['target']:.0%} | "
                    f"{sp['engine']:.0%} | {sp['outside']:.0%} |"
                )

    e_row = next((r for r in rows if r.get("key") == "e"), None)
    md = [
        "# specd engine benchmark (CPU)",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"- {meta['models']}",
        f"- {meta['machine']}",
        f"- greedy, {args.max_tokens} new tokens per prompt (EOS ignored), batch 1 = {meta['n_b1']} prompts "
        f"one at a time, batch {BATCH} = {BATCH} prompts in one call; median of {args.repeats} interleaved "
        "repeats after one warm-up",
        f"- fixed k = {args.k}; adaptive rows search k in 0..8; the k column is the mean drafts per decoding "
        "sequence-step",
        "",
        table,
        "Notes:",
        "",
        "- speedup vs off: against (a) specd with speculation off at the same batch size. measured/bound: the "
        "row's speedup over its own implementation's non-speculative decoding ((a), or (f) for (e)) divided "
        "by the bound.",
        "- bound = (1 − α_geo^(k+1)) / ((1 − α_geo)(k·c + 1)). α is the engine's acceptance_rate (accepted / "
        "drafted); α_geo is the per-token acceptance of the geometric model that gives the measured mean "
        "accepted length (acceptance_rate undercounts: drafts after the first rejection are never accepted), "
        "and is what the bound uses.",
        "- c = time of one draft forward / one target forward, 1 new token per sequence at a mid-generation "
        f"context ({meta['ctx']} tokens), timed directly through the engine's ModelRunner.forward (the HF "
        "models' cached forward for (e)), interleaved, median; batch-8 rows time 8 sequences per forward. "
        "For n-gram rows the draft cost is one prompt-lookup call per sequence.",
        "- (e) and (f) are transformers `generate` at batch 1 only: HF assisted generation supports batch 1. "
        "(e) uses HF's default assistant settings (up to 20 candidates, confidence threshold 0.4); its α, "
        "mean accepted length and k come from counting target and assistant forward calls."
        + (f" Speedup of (e) over (f): {e_row['base_speedup']:.2f}x." if e_row and "base_speedup" in e_row else ""),
        f"- (g) uses an unrelated random draft model of the draft's architecture (different seed). Against (a): "
        f"{g_check}.",
        "- Speedups are medians over repeats of the per-repeat ratio to the baseline run in the same repeat; "
        "tok/s are medians of each configuration alone.",
        f"- The adaptive policy's own cost ratio after the run (engine.policy.cost_ratio, which includes the "
        f"target's marginal cost per verified token): {policy_cs}.",
        f"- greedy outputs identical to (a) at the same batch size (prompts): {', '.join(checks)}. Random models "
        "have near-tied logits, so a mismatch between batch sizes or against transformers can be float "
        "rounding, not a bug; within one batch size specd should match exactly.",
        "",
        "The bound treats a target forward over k + 1 tokens as costing the same as over 1 token. On this CPU it "
        f"does not (target forward on n new tokens per sequence vs 1, measured like c: {verify_sizes}). With "
        "that cost, bound_v = E(α_geo, k) / (v(k+1) + k·c):",
        "",
        "| config | batch | k+1 | v(k+1) | bound_v | speedup vs off | measured/bound_v |",
        "|---|---|---|---|---|---|---|",
        *verify_lines,
        "",
        "Where the specd time goes (shares of wall time; engine = the step's own work outside the draft and "
        "target forwards: scheduling, verification, bookkeeping; outside = the generate loop around steps):",
        "",
        "| config | batch | steps | draft fwd | target fwd | engine | outside steps |",
        "|---|---|---|---|---|---|---|",
        *split_lines,
        "",
    ]
    return "\n".join(md), rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [7, 5]})
    for ax, b in zip(axes, (1, BATCH), strict=True):
        sel = [r for r in rows if r["batch"] == b and "rate" in r]
        names = [r["label"].split(")")[0] + ")" for r in sel]
        rates = [r["rate"] for r in sel]
        colors = ["#888888" if r["key"] in ("a", "f") else "#d62728" if r["key"] == "g" else "#1f77b4" for r in sel]
        bars = ax.bar(names, rates, color=colors)
        for bar, r in zip(bars, sel, strict=True):
            ax.annotate(f"{r['rate']:.0f}\n{r['speedup']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_title(f"batch {b}" + (" (HF rows: batch 1 only)" if b == 1 else ""))
        ax.set_ylabel("generated tokens / s")
        ax.set_ylim(0, max(rates) * 1.25)
    legend = "\n".join(sorted({r["label"] for r in rows if "rate" in r}))
    fig.text(0.01, 0.01, legend, fontsize=7, va="bottom", family="monospace")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.22, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    global QUICK, NGRAM_CONTEXT
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
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "bench_engine.png")
    args = ap.parse_args()
    if (args.target is None) != (args.draft is None):
        ap.error("give both --target and --draft, or neither")
    QUICK = args.quick
    if args.quick:
        args.max_tokens = min(args.max_tokens, 24)
        args.repeats = 1
        args.batch1_prompts = min(args.batch1_prompts, 2)

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
            size = "quick: hidden 64, 4 layers" if args.quick else "hidden 512, 8 layers, 8 heads"
            models = (
                f"target: random Llama built here ({size}, "
                f"vocab 320, embedding std {args.embed_std or 'HF init'}, seed {args.seed}); draft: its first "
                f"{args.draft_layers} layer(s) + embeddings, final norm, lm_head"
            )
        else:
            target_dir, draft_dir = args.target, args.draft
            models = f"target: {target_dir}; draft: {draft_dir}"
        useless_dir = build_useless_draft(draft_dir, workdir / "useless", args.seed)
        models += "; useless drafter for (g): the draft's architecture, fresh random weights"

        vocab = AutoConfig.from_pretrained(target_dir).get_text_config().vocab_size
        n_prompts = max(BATCH, args.batch1_prompts)
        prompts = make_prompts(target_dir, n_prompts, vocab, max_len=64)
        max_model_len = max(len(p) for p in prompts) + args.max_tokens + 32
        ctx = int(statistics.mean(len(p) for p in prompts)) + args.max_tokens // 2

        log.info("loading the configurations (threads=%d)", args.threads)
        common = dict(model=str(target_dir), max_tokens=args.max_tokens, max_model_len=max_model_len)
        configs: list[Config] = [
            SpecdConfig("a", "(a) specd, speculation off", speculative_method="none", **common),
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
        NGRAM_CONTEXT = prompts[0] + configs[0].llm.generate([prompts[0]], configs[0].params)[0].token_ids  # type: ignore[attr-defined]

        benchmark(configs, prompts, args.batch1_prompts, args.repeats, ctx)

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
