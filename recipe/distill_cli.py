"""The `specd distill` command line: flags, corpus choice and draft shape. Imports torch only when it runs."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

logger = logging.getLogger("recipe")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target model directory or hub id (its tokenizer is used)")
    p.add_argument("--out", required=True, help="directory to write the draft to")
    p.add_argument("--corpus", nargs="+", help="text files or directories (default: the Python stdlib's train split)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--hidden-size", type=int, help="draft width (default: a quarter of the target's)")
    p.add_argument("--num-layers", type=int, help="draft depth (default: an eighth of the target's)")
    p.add_argument("--num-heads", type=int, help="attention heads (default: width / 32)")
    p.add_argument("--intermediate-size", type=int, help="MLP width (default: 3x the width)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--trust-remote-code", action="store_true")


def run(args: argparse.Namespace) -> int:
    from transformers import AutoConfig

    from recipe.corpus import split, stdlib_files, text_files
    from recipe.distill import DraftShape, distill
    from recipe.train import TrainConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    held_out = None
    if args.corpus:
        corpus = text_files(args.corpus)
    else:
        corpus, held_out = split(stdlib_files())
    shape = None
    if any(v is not None for v in (args.hidden_size, args.num_layers, args.num_heads, args.intermediate_size)):
        base = DraftShape.for_target(AutoConfig.from_pretrained(args.target, trust_remote_code=args.trust_remote_code))
        hidden = args.hidden_size or base.hidden_size
        shape = DraftShape(
            hidden,
            args.num_layers or base.num_layers,
            args.num_heads or max(1, hidden // 32),
            args.intermediate_size or hidden * 3,
        )
    if args.trust_remote_code:
        logger.warning("--trust-remote-code: the target's repository code will run in this process")
    cfg = TrainConfig(steps=args.steps, lr=args.lr, log_every=args.log_every, eval_every=max(1, args.steps // 5))
    distill(args.target, Path(args.out), corpus, shape, cfg, args.seq_len, args.batch_size, args.seed, args.device,
            held_out=held_out, trust_remote_code=args.trust_remote_code)
    return 0
