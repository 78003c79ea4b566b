"""Measure the default pair on the held-out split: the figures the README quotes.

    python -m recipe.evaluate [--pair models/default] [--prompts 16] [--max-tokens 128]

Prints a table and writes EVAL.json beside the pair. Every figure comes from this run: bits per byte of
target and draft over the whole held-out split, and, through specd's engine at batch 1 (one request at a
time, greedy), the acceptance rate at k = 4, the mean tokens per verify step, and tokens/s with and without
speculation, measured in interleaved rounds so machine noise hits every configuration alike.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import LLM, SamplingParams, exit_head
from recipe import tokenizer as bpe
from recipe.corpus import split, stdlib_files
from recipe.data import eval_windows, token_stream
from recipe.objectives import bits_per_byte

REPO_ROOT = Path(__file__).resolve().parents[1]


def held_out_prompts(tokenizer: object, n: int, prompt_tokens: int = 96, mid_line: bool = False) -> list[list[int]]:
    """n prompts of ~prompt_tokens tokens from the held-out files, each cut just after a newline so the
    completion starts a fresh line (``mid_line``: wherever the window ends, mostly inside a line); evenly
    spaced through the held-out token stream."""
    _, held_out = split(stdlib_files())
    stream = token_stream(held_out, tokenizer).tolist()
    newline_ids = {i for tok, i in tokenizer.get_vocab().items() if tok.endswith("Ċ")}
    eos = tokenizer.eos_token_id
    prompts = []
    stride = len(stream) // n
    for j in range(n):
        end = j * stride + prompt_tokens
        while not mid_line and end < len(stream) and stream[end - 1] not in newline_ids:
            end += 1
        window = stream[end - prompt_tokens : end]
        if eos in window:  # do not straddle two files
            window = window[window.index(eos) + 1 :] or window
        prompts.append(window)
    return prompts


def measure_bpb(target: Path, draft: Path, self_target: Path | None = None) -> dict[str, float]:
    """Held-out bits per byte of the target and the draft, and of ``self_target`` when its weights are not the
    target's (a target tuned by ``specd distill --method self --tune-layers``)."""
    tok = AutoTokenizer.from_pretrained(target)
    _, held_out = split(stdlib_files())
    windows = eval_windows(token_stream(held_out, tok), 512)
    lengths = torch.tensor(bpe.token_byte_lengths(tok))
    models = [("target", target), ("draft", draft)]
    if self_target is not None and (self_target / "model.safetensors").read_bytes() != (
            target / "model.safetensors").read_bytes():
        models.append(("self_target", self_target))
    out = {}
    for name, path in models:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out[name] = bits_per_byte(model, windows, lengths)
    return out


def run_engine(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, int]:
    """Sequential requests, greedy. Returns (outputs, seconds, generated tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs, seconds, tokens = [], 0.0, 0
    for p in prompts:
        t0 = time.perf_counter()
        (result,) = llm.generate([p], params)
        seconds += time.perf_counter() - t0
        outputs.append(list(result.token_ids))
        tokens += len(result.token_ids)
    return outputs, seconds, tokens


class StepTimes:
    """Per engine step, the seconds spent drafting and in the target's forward, as the engine timed them."""

    def __init__(self, llm: LLM) -> None:
        self.steps, self.draft, self.target = 0, 0.0, 0.0
        engine, step = llm.engine, llm.engine.step

        def timed():  # noqa: ANN202
            outputs = step()
            if engine.last_step is not None and outputs:
                self.steps += 1
                self.draft += engine.last_step.draft_seconds
                self.target += engine.last_step.target_seconds
            return outputs

        engine.step = timed  # type: ignore[method-assign]

    def cost_ratio(self, draft_tokens: int) -> float | None:
        """c = drafting seconds per draft token / target seconds per step (drafting includes a draft model's
        catch-ups and the host work of drafting); None without drafts."""
        if not draft_tokens or not self.steps:
            return None
        return round((self.draft / draft_tokens) / (self.target / self.steps), 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m recipe.evaluate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=REPO_ROOT / "models" / "default")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--draft", type=Path, help="another draft to measure with the pair's target (default: PAIR/draft)")
    ap.add_argument("--eagle", type=Path, help="an EAGLE-3 head for the pair's target (default: PAIR/eagle)")
    ap.add_argument("--self-target", type=Path,
                    help="the target with a trained exit head (specd distill --method self) for the 'self exit' "
                    "configurations (default: PAIR/target when it has one)")
    ap.add_argument("--mid-line", action="store_true", help="prompts end wherever their window does, mostly "
                    "inside a line (default: just after a newline)")
    ap.add_argument("--configs", help="comma-separated subset of the configurations (names as printed); the "
                    "self-speculation ones run only when named")
    ap.add_argument("--json", type=Path, help="where to write the figures (default: PAIR/EVAL.json)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    target, draft = str(args.pair / "target"), str(args.draft or args.pair / "draft")
    tok = AutoTokenizer.from_pretrained(target)
    prompts = held_out_prompts(tok, args.prompts, mid_line=args.mid_line)

    common = {"dtype": "float32", "device": "cpu"}
    makers: dict[str, Callable[[], LLM]] = {
        "speculation off": lambda: LLM(target, speculative_method="none", **common),
        "draft k=4": lambda: LLM(target, draft_model=draft, speculative_method="draft_model",
                                 num_speculative_tokens=4, **common),
        "draft adaptive": lambda: LLM(target, draft_model=draft, speculative_method="draft_model", **common),
        "ngram adaptive": lambda: LLM(target, speculative_method="ngram", **common),
        "hybrid adaptive": lambda: LLM(target, draft_model=draft, speculative_method="hybrid", **common),
    }
    # self-speculation through the target's own head, untrained (not run unless named)
    for layers in (1, 2, 3):
        makers[f"self L={layers} k=4"] = lambda n=layers: LLM(target, speculative_method="self", draft_layers=n,
                                                               exit_head=False, num_speculative_tokens=4, **common)
    makers["self L=2 adaptive"] = lambda: LLM(target, speculative_method="self", draft_layers=2, exit_head=False,
                                              **common)
    eagle = str(args.eagle or args.pair / "eagle")
    if Path(eagle).is_dir():  # the head reads the target's hidden states; "hybrid eagle": with prompt lookup
        makers["eagle k=4"] = lambda: LLM(target, draft_model=eagle, speculative_method="eagle",
                                          num_speculative_tokens=4, **common)
        makers["eagle adaptive"] = lambda: LLM(target, draft_model=eagle, speculative_method="eagle", **common)
        makers["hybrid eagle"] = lambda: LLM(target, draft_model=eagle, speculative_method="hybrid", **common)
    self_target = args.self_target or (Path(target) if exit_head.find(target) else None)
    if self_target is not None:  # the early exit through its trained head, at the head's depth
        st = str(self_target)
        if exit_head.find(st) is None:
            ap.error(f"--self-target {st} has no {exit_head.DIR_NAME}/")
        makers["self exit k=4"] = lambda: LLM(st, speculative_method="self", num_speculative_tokens=4, **common)
        makers["self exit adaptive"] = lambda: LLM(st, speculative_method="self", **common)
        layers = exit_head.exit_layers(exit_head.find(st))
        makers["hybrid self exit"] = lambda: LLM(st, draft_model=draft, draft_layers=layers,
                                                 speculative_method="hybrid", **common)
    opt_in = {name for name in makers if "self" in name}
    bpb = measure_bpb(Path(target), Path(draft), self_target)
    named = {c.strip() for c in args.configs.split(",")} | {"speculation off"} if args.configs else None
    wanted = named if named is not None else set(makers) - opt_in
    tuned = "self_target" in bpb and any("self exit" in name for name in wanted)
    if tuned:  # a tuned target: its own configurations compare with it, not with the original
        makers["self target off"] = lambda: LLM(st, speculative_method="none", **common)
        wanted.add("self target off")
    own_off = {name: "self target off" if tuned and "self exit" in name else "speculation off" for name in makers}
    if wanted - set(makers):
        ap.error(f"unknown configurations {sorted(wanted - set(makers))}; known: {', '.join(makers)}")
    configs = {name: make() for name, make in makers.items() if name in wanted}
    for llm in configs.values():  # warm-up: first-call allocations and the adaptive policy's calibration
        run_engine(llm, prompts[:2], 16)
    times = {name: StepTimes(llm) for name, llm in configs.items()}
    base = {name: copy.deepcopy(llm.stats()) for name, llm in configs.items()}  # stats() is live
    rates: dict[str, list[float]] = {name: [] for name in configs}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for name, llm in configs.items():
            outs, secs, n = run_engine(llm, prompts, args.max_tokens)
            rates[name].append(n / secs)
            outputs[name] = outs
    rows = {}
    for name, llm in configs.items():
        off = own_off[name]
        reference = outputs[off]
        s, b = llm.stats(), base[name]
        drafts = s.num_drafts - b.num_drafts
        draft_tokens = s.num_draft_tokens - b.num_draft_tokens
        accepted = s.num_accepted_tokens - b.num_accepted_tokens
        tps = statistics.median(rates[name])
        rows[name] = {
            "tokens_per_s": round(tps, 1),
            "speedup": round(tps / statistics.median(rates[off]), 3),
            "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else None,
            "mean_accepted_per_step": round(accepted / drafts, 3) if drafts else None,
            "identical_to_target": sum(o == r for o, r in zip(outputs[name], reference)),
            # Seconds per draft token over seconds per target forward, as the engine timed them in this run.
            "cost_ratio": times[name].cost_ratio(draft_tokens),
        }
    result = {
        "draft": os.path.relpath(draft, REPO_ROOT),
        "self_target": None if self_target is None else os.path.relpath(self_target, REPO_ROOT),
        "prompt_ends": "mid-line" if args.mid_line else "line end",
        "held_out_bits_per_byte": {k: round(v, 4) for k, v in bpb.items()},
        "prompts": len(prompts), "max_tokens": args.max_tokens, "rounds": args.rounds,
        "threads": torch.get_num_threads(), "engine": rows,
    }
    print("held-out bits/byte: " + ", ".join(f"{k} {v:.3f}" for k, v in bpb.items()))
    print(f"{'config':<18}{'tok/s':>8}{'speedup':>9}{'accept':>8}{'acc/step':>10}{'c':>7}{'same':>7}")
    for name, r in rows.items():
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
        per = "-" if r["mean_accepted_per_step"] is None else f"{r['mean_accepted_per_step']:.2f}"
        c = "-" if r["cost_ratio"] is None else f"{r['cost_ratio']:.3f}"
        print(f"{name:<18}{r['tokens_per_s']:>8.1f}{r['speedup']:>8.2f}x{acc:>8}{per:>10}{c:>7}"
              f"{r['identical_to_target']:>4}/{len(prompts)}")
    (args.json or args.pair / "EVAL.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
