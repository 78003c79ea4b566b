"""The layouts a compiled forward is warmed up on: every shape a decode, verify or draft catch-up step can
bring, so that no request waits for a compile."""

from __future__ import annotations

from engine.layers import small_linear
from engine.layers.attention_metadata import SHORT_QUERY
from engine.worker.forward_batch import ForwardBatch

# The warm-up's sequences: their context; HALF of them (or their rows) are within small_linear's SMALL_ROWS, twice
# as many past it. A batch of sequences feeding FEED tokens each passes SMALL_ROWS at SEQS of them: every sequence
# stays a short query (a longer one is a prompt chunk, never compiled), so past a split of 64 that takes three.
CONTEXT = 40
HALF = small_linear.SMALL_ROWS // 2 + 1
FEED = min(HALF, SHORT_QUERY)
SEQS = small_linear.SMALL_ROWS // FEED + 1
ALONE = min(2 * HALF, SHORT_QUERY)  # the most tokens one sequence feeds in a catch-up or short prompt


def _most_fed(k_max: int) -> int:
    return max(k_max + 1, FEED, ALONE)


def warm_up_blocks(k_max: int, block_size: int) -> int:
    """The blocks ``warm_up_layouts`` writes into, at most."""
    return 2 * -(-(CONTEXT + _most_fed(k_max)) // block_size)


def warm_up_layouts(k_max: int, block_size: int, num_blocks: int, first_block: int = 0) -> list[ForwardBatch]:
    """One sequence (its blocks in order or not) decoding, verifying k_max drafts or catching up, and two
    sequences over a gathered cache, masked or not, within small_linear.SMALL_ROWS rows and past it. They write
    into blocks ``first_block`` on (``warm_up_blocks`` of them, fewer in a small cache)."""
    bs, n = block_size, num_blocks - first_block
    big, extra = HALF, _most_fed(k_max)
    # two sequences' worth of blocks, even in a small cache
    ctx = max(2, min(CONTEXT, (n // 2) * bs - extra))
    need = -(-(ctx + extra) // bs)
    one = list(range(first_block, first_block + need))
    other = list(range(first_block + 2 * need - 1, first_block + need - 1, -1))
    several = [ctx, ctx // 2] * (SEQS // 2) + [ctx] * (SEQS % 2), [one, other] * (SEQS // 2) + [one] * (SEQS % 2)
    layouts = [
        ForwardBatch([[0]], [ctx], [table], [1])
        for table in (one, other)  # blocks in order (read as one span) or not (gathered)
    ] + [
        # a one-token prompt arriving alone: a context of one is a size dynamo specializes (0/1), its own graph
        ForwardBatch([[0]], [0], [one], [1]),
    ] + [
        ForwardBatch([[0] * rows], [ctx], [table], [rows])
        # past SMALL_ROWS, verifying fewer drafts than k_max is another graph
        for rows in sorted({k_max + 1, min(k_max + 1, small_linear.SMALL_ROWS)}) for table in (one, other)
    ] + [
        ForwardBatch([[0] * rows], [ctx], [table], [1])
        # a catch-up or a short prompt: one row's logits (a prompt of up to SHORT_QUERY tokens arriving alone
        # ran eagerly until this layout was here)
        for rows in (3, ALONE) for table in (one, other)
    ] + [
        ForwardBatch([[0], [0]], [ctx, ctx // 2], [one, other], [1, 1]),
        ForwardBatch([[0], [0]], [ctx, ctx], [one, other], [1, 1]),  # equal contexts: no mask
        ForwardBatch([[0] * (k_max + 1), [0]], [ctx, ctx // 2], [one, other], [k_max + 1, 1]),
        ForwardBatch([[0] * (k_max + 1)] * 2, [ctx, ctx // 2], [one, other], [k_max + 1] * 2),  # all verifying
        ForwardBatch([[0] * 3, [0] * 2], [ctx, ctx // 2], [one, other], [1, 1]),
        # every sequence feeding as many tokens, one logits row each: a draft model catching up a batch whose
        # drafts were all accepted, or short prompts of one length admitted together (ran eagerly until
        # this layout was here), within SMALL_ROWS rows and past it
        ForwardBatch([[0] * 2] * 2, [ctx, ctx // 2], [one, other], [1, 1]),
        ForwardBatch([[0] * 2] * big, [ctx, ctx // 2] * (big // 2) + [ctx], [one, other] * (big // 2) + [one],
                     [1] * big),
        # and more of them than the LM head's SMALL_ROWS (it then takes its rows packed)
        ForwardBatch([[0] * 2] * (2 * big), [ctx, ctx // 2] * big, [one, other] * big, [1] * (2 * big)),
        # past SMALL_ROWS: all verifying (the step-cost model's start-up profile, at equal contexts), mixed k, and
        # short prompts admitted together, of unequal lengths
        ForwardBatch([[0] * FEED] * SEQS, *several, [FEED] * SEQS),
        ForwardBatch([[0] * FEED] * (SEQS - 1) + [[0] * (FEED - 1)], *several, [FEED] * (SEQS - 1) + [FEED - 1]),
        ForwardBatch([[0] * FEED] * (SEQS - 1) + [[0] * (FEED - 1)], *several, [1] * SEQS),
        # more sequences decoding than small_linear's rows (the sequences share blocks: nothing reads them)
        ForwardBatch([[0]] * (2 * big), [ctx, ctx // 2] * big, [one, other] * big, [1] * (2 * big)),
        # and at one context, no mask: prompts of one length admitted together, and the calibration's decodes
        # (32 and 64 of them ran eagerly, and the step-cost model priced them so, until this layout was here)
        ForwardBatch([[0]] * (2 * big), [ctx] * (2 * big), [one, other] * big, [1] * (2 * big)),
        # and a draft model catching up some of them, one logits row each
        ForwardBatch([[0] * 2] + [[0]] * (2 * big - 1), [ctx, ctx // 2] * big, [one, other] * big, [1] * (2 * big)),
    ]
    return layouts
