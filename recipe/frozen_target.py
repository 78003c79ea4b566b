"""What the recipes that train on a frozen target share: loading it, the token windows, the draft vocabulary."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from recipe import draft_vocab
from recipe.corpus import CorpusFile
from recipe.data import eval_windows, token_stream
from recipe.train import TrainConfig

logger = logging.getLogger("recipe")


@dataclass(frozen=True)
class TrainJob:
    """One run of a recipe that trains a drafter on a frozen target: what it reads, where it writes, how long
    it trains. What the drafter is (an EAGLE head, an exit head) is the recipe's own setup."""

    target_path: str
    out: Path
    corpus: list[CorpusFile]
    cfg: TrainConfig
    device: str = "auto"  # "auto": CUDA when there is one
    held_out: list[CorpusFile] | None = None  # None: evaluate on the training corpus
    corpus_name: str = ""  # how the training record names the corpus
    trust_remote_code: bool = False


def load_frozen(target_path: str, dev: torch.device,
                trust_remote_code: bool = False) -> tuple[PreTrainedTokenizerBase, torch.nn.Module, torch.dtype | str]:
    """(tokenizer, the target in eval mode without grads, the dtype its checkpoint was saved in). fp32 on the
    CPU, where bf16 matmuls are slower (recipe/distill.py); bf16 on CUDA."""
    tokenizer = AutoTokenizer.from_pretrained(target_path, trust_remote_code=trust_remote_code)
    saved_dtype = AutoConfig.from_pretrained(target_path, trust_remote_code=trust_remote_code).get_text_config().dtype
    target = AutoModelForCausalLM.from_pretrained(
        target_path, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32,
        trust_remote_code=trust_remote_code,
    ).to(dev).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    return tokenizer, target, saved_dtype


@dataclass(frozen=True)
class Corpus:
    stream: torch.Tensor  # [N] the training corpus's tokens
    eval_split: str  # "held_out", or "train" when there is no held-out split
    eval_tokens: int
    windows: torch.Tensor  # [W, seq_len] evaluation windows on the device


def tokenize(corpus: list[CorpusFile], held_out: list[CorpusFile] | None, tokenizer: PreTrainedTokenizerBase,
             seq_len: int, max_windows: int, dev: torch.device) -> Corpus:
    stream = token_stream(corpus, tokenizer)
    eval_split = "held_out" if held_out else "train"
    eval_stream = token_stream(held_out, tokenizer) if held_out else stream
    windows = eval_windows(eval_stream, seq_len - 1, max_windows=max_windows).to(dev)  # [W, seq_len]
    if windows.shape[0] == 0:
        raise ValueError(f"the {eval_split} split has {eval_stream.numel()} tokens, fewer than one window of {seq_len}")
    return Corpus(stream, eval_split, eval_stream.numel(), windows)


def choose_draft_vocab(logits: Callable[[torch.Tensor], torch.Tensor], data: Corpus, vocab: int, size: int | None,
                       what: str) -> tuple[int, dict[int, float], torch.Tensor, int]:
    """(size, coverage by candidate size, sorted target ids [size] on the windows' device, the number of argmax
    tokens the coverage counts): the corpus's most
    frequent tokens, sized by coverage of the target's argmaxes over the eval windows (recipe/draft_vocab.py).
    ``logits`` maps windows [B, L] to the target's logits [B, L', V]."""
    with torch.no_grad():
        argmaxes = torch.cat([logits(data.windows[i : i + 8]).argmax(-1).cpu()
                              for i in range(0, data.windows.shape[0], 8)])
    ranking = draft_vocab.frequency_ranking(data.stream, vocab)
    size, table = draft_vocab.choose(ranking, argmaxes, size)
    logger.info("%s: draft vocabulary %d of %d; coverage of %d %s target argmaxes: %s", what, size, vocab,
                argmaxes.numel(), data.eval_split, "  ".join(f"{n}: {c:.4f}" for n, c in table.items()))
    return size, table, ranking[:size].sort().values.to(data.windows.device), argmaxes.numel()
