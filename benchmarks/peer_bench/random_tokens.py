"""random: prompts of token ids drawn uniformly from the tokenizer's vocabulary, decoded to text.

Nothing in them repeats or reads as code, so no drafter finds a match: the workload where speculation
can only cost. Seeded per prompt, so a set is the same on every run and the first n prompts do not
depend on how many are asked for.
"""

from __future__ import annotations

import functools
import random

SEED = 20261125
TOKENS = 96


@functools.cache
def _vocabulary(tokenizer: object) -> tuple[int, ...]:
    """Ids that decode to text on their own: no special tokens, no lone bytes of a multi-byte character."""
    special = set(tokenizer.all_special_ids)
    return tuple(i for i in range(len(tokenizer)) if i not in special
                 and (piece := tokenizer.decode([i])) and "\ufffd" not in piece)


def random_prompts(tokenizer: object, n: int) -> list[str]:
    vocab = _vocabulary(tokenizer)
    out = []
    for k in range(n):
        rng = random.Random(f"{SEED}-{k}")  # str seeds hash the same in every process
        out.append(tokenizer.decode([rng.choice(vocab) for _ in range(TOKENS)]))
    return out
