"""Whether an output is a repetition loop: a looping tiny model flatters any lookup drafter, whose
drafts of a loop are always accepted, so the share of looping outputs goes beside each throughput.

The rule (periodicity, not a compression ratio: it names the loop and is cheap on 128 tokens): an
output of at least MIN_TOKENS tokens loops when, for some period p <= MAX_PERIOD (and at most half the
output, so the repeat shows at least twice), at least MATCH of the tokens in its last half equal the
token p positions earlier. MATCH is below 1 because the text is re-tokenized for counting and its
last token may merge differently from the model's own; a text that repeats its shape with a change
every period (a counter going up) stays below it.
"""

from __future__ import annotations

MAX_PERIOD = 64
MIN_TOKENS = 16
MATCH = 0.9


def is_loop(ids: list[int], max_period: int = MAX_PERIOD) -> bool:
    n = len(ids)
    if n < MIN_TOKENS:
        return False
    half = n // 2
    need = MATCH * (n - half)
    for p in range(1, min(max_period, half) + 1):
        if sum(ids[i] == ids[i - p] for i in range(half, n)) >= need:
            return True
    return False
