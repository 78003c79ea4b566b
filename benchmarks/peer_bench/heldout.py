"""Cuts from the default pair's held-out split (files the models never saw), shared by the prompt sets."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from recipe.corpus import CorpusFile, split, stdlib_files


@functools.cache
def held_out_files() -> tuple[CorpusFile, ...]:
    """The held-out files with more than 60 lines, sorted by path: enough text to cut from."""
    _, held_out = split(stdlib_files())
    return tuple(sorted((f for f in held_out if f.read().count("\n") > 60), key=lambda f: f.relpath))


def context_of(tokenizer: object, fallback: int = 2048) -> int:
    """The model's context length, from the config.json beside its tokenizer: long-prompt sets are sized
    to fit it (the embedded pair's is 512 tokens, and a prompt plus max_tokens beyond it is a 400)."""
    config = Path(str(getattr(tokenizer, "name_or_path", ""))) / "config.json"
    try:
        return int(json.loads(config.read_text()).get("max_position_embeddings", fallback))
    except (OSError, ValueError):
        return fallback


def snippets(tokenizer: object, n: int, tokens: int) -> list[str]:
    """n snippets of >= ``tokens`` tokens of whole lines, from the middle of n held-out files spread
    through the split; each starts at a non-blank line and ends without a trailing newline (this
    tokenizer merges a newline with the next line's indentation, so a prompt ending in a bare newline
    is a token boundary the model never saw)."""
    files = held_out_files()
    out = []
    for k in range(n):
        # Spread over the files; a file used again starts at another point of its text.
        f = files[(k * max(1, len(files) // n)) % len(files)]
        lines = f.read().split("\n")
        # Start at a top-level or class-level statement from a third of the way in (wrapping round),
        # so the snippet stands on its own; the first start with enough lines after it wins.
        first = int(len(lines) * ((1 / 3 + 0.29 * (k // len(files))) % 1.0))
        for i in [*range(first, len(lines)), *range(first)]:
            if lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) <= 4:
                taken: list[str] = []
                j = i
                while j < len(lines) and len(tokenizer.encode("\n".join(taken))) < tokens:
                    taken.append(lines[j])
                    j += 1
                if len(tokenizer.encode("\n".join(taken))) >= tokens:
                    out.append("\n".join(taken).rstrip())
                    break
    return out
