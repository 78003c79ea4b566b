"""The layouts a compiled forward is warmed up on: every shape a decode, verify or draft catch-up step can
bring, so that no request waits for a compile."""

from __future__ import annotations

from engine.layers import small_linear
from engine.worker.forward_batch import ForwardBatch

# The warm-up's sequences: their context, and the rows of its batched layouts (two such sequences are past
# small_linear's fused products: the graph batched steps use).
CONTEXT = 40
ROWS = small_linear.SMALL_ROWS // 2 + 1


def warm_up_blocks(k_max: int, block_size: int) -> int:
    """The blocks ``warm_up_layouts`` writes into, at most."""
    return 2 * -(-(CONTEXT + max(k_max + 1, 2 * ROWS)) // block_size)


def warm_up_layouts(k_max: int, block_size: int, num_blocks: int, first_block: int = 0) -> list[ForwardBatch]:
    """One sequence (its blocks in order or not) decoding, verifying k_max drafts or catching up, and two
    sequences over a gathered cache, masked or not, within small_linear.SMALL_ROWS rows and past it. They write
    into blocks ``first_block`` on (``warm_up_blocks`` of them, fewer in a small cache)."""
    bs, n = block_size, num_blocks - first_block
    big = ROWS
    extra = max(k_max + 1, 2 * big)  # the most tokens one sequence feeds
    # two sequences' worth of blocks, even in a small cache
    ctx = max(2, min(CONTEXT, (n // 2) * bs - extra))
    need = -(-(ctx + extra) // bs)
    one = list(range(first_block, first_block + need))
    other = list(range(first_block + 2 * need - 1, first_block + need - 1, -1))
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
        # a catch-up or a short prompt: one row's logits, from at most SMALL_ROWS rows or more (a prompt of
        # up to attention_metadata.SHORT_QUERY tokens arriving alone ran eagerly until this layout was here)
        for rows in (3, 2 * big) for table in (one, other)
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
        ForwardBatch([[0] * big] * 2, [ctx, ctx // 2], [one, other], [big] * 2),
        ForwardBatch([[0] * big, [0] * (big - 1)], [ctx, ctx // 2], [one, other], [big, big - 1]),  # mixed k
        # short prompts admitted together, of unequal lengths
        ForwardBatch([[0] * big, [0] * (big - 1)], [ctx, ctx // 2], [one, other], [1, 1]),
        # more sequences decoding than small_linear's rows (the sequences share blocks: nothing reads them)
        ForwardBatch([[0]] * (2 * big), [ctx, ctx // 2] * big, [one, other] * big, [1] * (2 * big)),
        # and at one context, no mask: prompts of one length admitted together, and the calibration's decodes
        # (32 and 64 of them ran eagerly, and the step-cost model priced them so, until this layout was here)
        ForwardBatch([[0]] * (2 * big), [ctx] * (2 * big), [one, other] * big, [1] * (2 * big)),
        # and a draft model catching up some of them, one logits row each
        ForwardBatch([[0] * 2] + [[0]] * (2 * big - 1), [ctx, ctx // 2] * big, [one, other] * big, [1] * (2 * big)),
    ]
    return layouts
