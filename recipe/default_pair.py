"""The embedded default pair, from nothing: `python -m recipe.default_pair` (or `make default-pair`).

Stages, each reading the previous one's output under --out:
  tokenizer  byte-level BPE on the stdlib's train split, plus the corpus manifest
  target     a ~14M-parameter Llama trained from a seed with next-token cross-entropy
  draft      a ~1.5M-parameter Llama distilled from the target (KL), via the same code as `specd distill`
  draft-data (not part of "all") the same draft trained on the corpus alone, for the acceptance comparison
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from recipe import tokenizer as bpe
from recipe.corpus import manifest, split, stdlib_files, stdlib_root
from recipe.data import eval_windows, random_windows, token_stream
from recipe.distill import DraftShape, distill, draft_config, param_count
from recipe.objectives import bits_per_byte, next_token_loss
from recipe.train import TrainConfig, train

logger = logging.getLogger("recipe")

REPO_ROOT = Path(__file__).resolve().parents[1]
VOCAB_SIZE = 8192
SEQ_LEN = 512
BATCH_SIZE = 8
TARGET_SHAPE = {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 6}
DRAFT_SHAPE = DraftShape(hidden_size=128, num_layers=2, num_heads=4, intermediate_size=384)


def stage_tokenizer(out: Path) -> None:
    files = stdlib_files()
    train_files, held_out = split(files)
    t0 = time.perf_counter()
    tok = bpe.train_bpe((f.read() for f in train_files), VOCAB_SIZE, SEQ_LEN)
    bpe.save(tok, out / "target")
    record = {
        "python": platform.python_version(),
        "stdlib_root": str(stdlib_root()),
        "train_files": len(train_files),
        "held_out_files": len(held_out),
        "train_bytes": sum(f.path.stat().st_size for f in train_files),
        "held_out_bytes": sum(f.path.stat().st_size for f in held_out),
        "files": manifest(files),
    }
    (out / "corpus.json").write_text(json.dumps(record, indent=1) + "\n")
    logger.info("tokenizer: %d tokens trained on %d files in %.1fs", len(tok), len(train_files),
                time.perf_counter() - t0)


def stage_target(out: Path, steps: int, seed: int, lr: float) -> None:
    tok = AutoTokenizer.from_pretrained(out / "target")
    train_files, held_out = split(stdlib_files())
    stream = token_stream(train_files, tok)
    held = token_stream(held_out, tok)
    byte_lengths = torch.tensor(bpe.token_byte_lengths(tok))
    windows = eval_windows(held, SEQ_LEN, max_windows=32)
    logger.info("target: %d train tokens, %d held-out tokens", stream.numel(), held.numel())
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok), max_position_embeddings=SEQ_LEN, tie_word_embeddings=True,
        num_key_value_heads=TARGET_SHAPE["num_attention_heads"], bos_token_id=None,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **TARGET_SHAPE,
    )
    model = LlamaForCausalLM(config)
    logger.info("target: %.2fM parameters", param_count(model) / 1e6)
    cfg = TrainConfig(steps=steps, lr=lr, eval_every=max(1, steps // 4))
    result = train(
        model, random_windows(stream, BATCH_SIZE, SEQ_LEN, seed), next_token_loss, cfg,
        evaluate=lambda: bits_per_byte(model, windows, byte_lengths), what="target",
    )
    model.to(torch.bfloat16).save_pretrained(out / "target")
    tok.save_pretrained(out / "target")
    record = {
        "params": param_count(model), "shape": TARGET_SHAPE, "vocab_size": len(tok), "seq_len": SEQ_LEN,
        "batch_size": BATCH_SIZE, "seed": seed, "train": asdict(cfg), "tokens": result.tokens,
        "seconds": round(result.seconds, 1), "final_loss": result.final_loss,
        "held_out_bits_per_byte_fp32": result.evals, "threads": torch.get_num_threads(),
        "torch": torch.__version__, "precision": "fp32 (bf16 autocast measured ~3x slower on this CPU)",
    }
    (out / "target" / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    logger.info("target: saved to %s after %.1f min", out / "target", result.seconds / 60)


def stage_draft(out: Path, steps: int, seed: int, lr: float) -> None:
    train_files, held_out = split(stdlib_files())
    cfg = TrainConfig(steps=steps, lr=lr, eval_every=max(1, steps // 4))
    distill(str(out / "target"), out / "draft", train_files, DRAFT_SHAPE, cfg, SEQ_LEN, BATCH_SIZE, seed,
            device="cpu", held_out=held_out)


def stage_data_draft(out: Path, steps: int, seed: int, lr: float) -> None:
    """The comparison the README quotes: the same draft shape, steps and seed, trained on the corpus alone."""
    tok = AutoTokenizer.from_pretrained(out / "target")
    train_files, _ = split(stdlib_files())
    stream = token_stream(train_files, tok)
    target_config = AutoConfig.from_pretrained(out / "target")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(draft_config(target_config, DRAFT_SHAPE, SEQ_LEN))
    cfg = TrainConfig(steps=steps, lr=lr, eval_every=steps + 1)
    result = train(model, random_windows(stream, BATCH_SIZE, SEQ_LEN, seed), next_token_loss, cfg, what="data-draft")
    model.to(torch.bfloat16).save_pretrained(out / "draft-data")
    tok.save_pretrained(out / "draft-data")
    record = {"params": param_count(model), "train": asdict(cfg), "seed": seed, "tokens": result.tokens,
              "seconds": round(result.seconds, 1), "objective": "next-token cross-entropy on the corpus alone"}
    (out / "draft-data" / "training.json").write_text(json.dumps(record, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recipe.default_pair", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "models" / "default")
    p.add_argument("--stage", choices=("all", "tokenizer", "target", "draft", "draft-data"), default="all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-steps", type=int, default=1600)
    p.add_argument("--target-lr", type=float, default=2e-3)
    p.add_argument("--draft-steps", type=int, default=1000)
    p.add_argument("--draft-lr", type=float, default=3e-3)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    torch.set_num_threads(torch.get_num_threads())
    if args.stage in ("all", "tokenizer"):
        stage_tokenizer(args.out)
    if args.stage in ("all", "target"):
        stage_target(args.out, args.target_steps, args.seed, args.target_lr)
    if args.stage in ("all", "draft"):
        stage_draft(args.out, args.draft_steps, args.seed, args.draft_lr)
    if args.stage == "draft-data":
        stage_data_draft(args.out, args.draft_steps, args.seed, args.draft_lr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
