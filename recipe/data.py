"""Token streams from a corpus, and the batches training and evaluation read from them."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import PreTrainedTokenizerBase

from recipe.corpus import CorpusFile


def token_stream(files: list[CorpusFile], tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """[N] int64: every file's tokens followed by EOS, in file order (EOS marks where one file ends)."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for f in files:
        ids += tokenizer(f.read(), add_special_tokens=False)["input_ids"]
        if eos is not None:
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def random_windows(stream: torch.Tensor, batch_size: int, seq_len: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless [batch_size, seq_len + 1] windows at uniform random offsets, reproducible from the seed."""
    if stream.numel() <= seq_len + 1:
        raise ValueError(f"corpus has {stream.numel()} tokens, fewer than one window of {seq_len + 1}")
    gen = torch.Generator().manual_seed(seed)
    span = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(0, stream.numel() - seq_len - 1, (batch_size,), generator=gen)
        yield stream[starts[:, None] + span]


def eval_windows(stream: torch.Tensor, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """[W, seq_len + 1] windows overlapping by one token, so every token after the first is predicted once."""
    n = (stream.numel() - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    starts = torch.arange(n) * seq_len
    return stream[starts[:, None] + torch.arange(seq_len + 1)]
