"""The `specd distill` command line: flags, corpus choice and draft shape. Imports torch only when it runs.

--method draft_model (the default) trains a small Llama draft (recipe/distill.py); --method eagle trains an
EAGLE-3 head on the target's hidden states (recipe/eagle.py)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from recipe.corpus import CorpusFile
    from recipe.frozen_target import TrainJob

logger = logging.getLogger("recipe")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", choices=("draft_model", "eagle", "self"), default="draft_model",
                   help="draft_model: a small Llama distilled from the target (default); eagle: an EAGLE-3 head; "
                   "self: an exit head for the target's first --draft-layers layers (OUT: the target with it)")
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
    p.add_argument("--draft-vocab", type=int,
                   help="eagle: draft vocabulary size, the corpus's most frequent tokens (default: the smallest of "
                   "1024, 2048, 4096, ... covering 98%% of the target's held-out argmax tokens)")
    p.add_argument("--ttt-steps", type=int, default=3,
                   help="eagle: chain steps trained per window (training-time test), the target-fed step included")
    p.add_argument("--aux-layers", type=int, nargs=3, metavar="I",
                   help="eagle: the target layers whose inputs the head reads (default: vLLM's 2, n/2, n-3 when "
                   "distinct, else 1, n/2, n-1)")
    p.add_argument("--draft-layers", type=int,
                   help="self: the depth the early exit drafts from (default: a third of the target's layers)")
    p.add_argument("--tune-layers", action="store_true",
                   help="self: also fine-tune the target's first --draft-layers layers (early-exit loss plus the "
                   "KL of the full model to its original output); quality before and after goes to training.json")
    p.add_argument("--quality-weight", type=float, default=1.0,
                   help="self with --tune-layers: weight of the full model's KL to its original output")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--threads", type=int, help="CPU threads for training (default: torch's, all cores)")
    p.add_argument("--trust-remote-code", action="store_true")


def run(args: argparse.Namespace) -> int:
    from transformers import AutoConfig

    from recipe.corpus import split, stdlib_files, text_files
    from recipe.distill import DraftShape, distill
    from recipe.train import TrainConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    held_out = None
    if args.corpus:
        corpus = text_files(args.corpus)
        corpus_name = " ".join(args.corpus)
    else:
        corpus, held_out = split(stdlib_files())
        corpus_name = "the Python stdlib's train split (recipe/corpus.py), its held-out split for evaluation"
    given = [f"--{f.replace('_', '-')}" for f in ("hidden_size", "num_layers", "num_heads", "intermediate_size")
             if getattr(args, f) is not None]
    if args.method != "draft_model" and given:
        logger.error("distill: %s apply to --method draft_model only", ", ".join(given))
        return 2
    not_self = [flag for flag, on in (("--draft-layers", args.draft_layers is not None),
                                      ("--tune-layers", args.tune_layers)) if on]
    if args.method != "self" and not_self:
        logger.error("distill: %s apply to --method self only", ", ".join(not_self))
        return 2
    if args.method == "eagle":
        return _eagle(args, corpus, held_out, corpus_name)
    if args.method == "self":
        return _self(args, corpus, held_out, corpus_name)
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


def _eagle(args: argparse.Namespace, corpus: list[CorpusFile], held_out: list[CorpusFile] | None,
           corpus_name: str) -> int:
    from recipe.eagle import EagleSetup, train_eagle

    setup = EagleSetup(ttt_steps=args.ttt_steps, draft_vocab=args.draft_vocab,
                       aux_layers=tuple(args.aux_layers) if args.aux_layers else None, seq_len=args.seq_len,
                       batch_size=args.batch_size, seed=args.seed)
    train_eagle(_head_job(args, corpus, held_out, corpus_name), setup)
    return 0


def _self(args: argparse.Namespace, corpus: list[CorpusFile], held_out: list[CorpusFile] | None,
          corpus_name: str) -> int:
    from transformers import AutoTokenizer

    from recipe.self_distill import SelfSetup, train_exit

    setup = SelfSetup(exit_layers=args.draft_layers, draft_vocab=args.draft_vocab, tune_layers=args.tune_layers,
                      quality_weight=args.quality_weight, seq_len=args.seq_len, batch_size=args.batch_size,
                      seed=args.seed)
    job = _head_job(args, corpus, held_out, corpus_name)
    tokenizer = AutoTokenizer.from_pretrained(args.target, trust_remote_code=args.trust_remote_code)
    train_exit(job, setup, byte_lengths=_byte_lengths(tokenizer))
    return 0


def _head_job(args: argparse.Namespace, corpus: list[CorpusFile], held_out: list[CorpusFile] | None,
              corpus_name: str) -> TrainJob:
    """The run of a head recipe (eagle, self); both warm up for a tenth of the steps, at most 100."""
    from recipe.frozen_target import TrainJob
    from recipe.train import TrainConfig

    cfg = TrainConfig(steps=args.steps, lr=args.lr, log_every=args.log_every, eval_every=max(1, args.steps // 5),
                      warmup_steps=min(100, max(1, args.steps // 10)))
    if args.trust_remote_code:
        logger.warning("--trust-remote-code: the target's repository code will run in this process")
    return TrainJob(args.target, Path(args.out), corpus, cfg, args.device, held_out, corpus_name,
                    args.trust_remote_code)


def _byte_lengths(tokenizer: object) -> torch.Tensor | None:
    """Bytes each token spells, for byte-level BPE tokenizers (one character per byte); None for others."""
    import json

    import torch

    from recipe.tokenizer import token_byte_lengths

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or json.loads(backend.to_str()).get("decoder", {}).get("type") != "ByteLevel":
        return None
    return torch.tensor(token_byte_lengths(tokenizer))
