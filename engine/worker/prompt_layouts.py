"""The layouts a prompt chunk brings to a forward, compiled into graphs of their own beside the decode ones.

On 2 CPU cores an eager forward of a ~100-token prompt beside 7 decoding sequences took 25.5 ms, the same
layout compiled 14.6 ms (a 300-token one 61.5 against 33.2; the embedded target): the eager per-op overhead
of a step is paid by the decoders that ride along with every prompt that arrives alone. One prompt per
forward, fresh or after a cached prefix, alone or beside decoding and verifying sequences (as many drafts
each, or padded to the most), within small_linear.SMALL_ROWS rows and past it (its two kernels are two
graphs). A forward of two or more prompts beside short queries runs in parts (ModelRunner._in_parts), as
one of prompts alone does where two or more are past SMALL_ROWS (ForwardBatch.apart); others run eagerly.
Their graphs live in a file of their own (graph_files.prompt_artifact), so that changing these layouts leaves
the decode graphs shipped for every kind of CPU current. A server loads that file
where it is current and never compiles it itself: ``make compile-cache`` does (precompile.compile_prompts).
"""

from __future__ import annotations

from engine.layers import small_linear
from engine.worker.forward_batch import ForwardBatch

CONTEXT = 40  # the decoders' context, and the cached prefix of a prompt that is not fresh
SHORT = small_linear.SMALL_ROWS * 3 // 4  # a prompt that keeps the forward within SMALL_ROWS rows
LONG = small_linear.SMALL_ROWS + 32  # one that takes it past them


def prompt_blocks(k_max: int, block_size: int) -> int:
    """The blocks ``prompt_layouts`` writes into, at most."""
    return 3 * -(-(CONTEXT + max(LONG, k_max + 1)) // block_size)


def prompt_layouts(k_max: int, block_size: int, num_blocks: int, first_block: int = 0) -> list[ForwardBatch]:
    """Each writes into blocks ``first_block`` on (``prompt_blocks`` of them): the prompt in the first third, two
    decoding sequences in the others, one in order (a single decoder reads it as one span) and one not."""
    per = -(-(CONTEXT + max(LONG, k_max + 1)) // block_size)
    assert num_blocks - first_block >= 3 * per, "the cache is too small for the prompt layouts"
    prompt = list(range(first_block, first_block + per))
    one = list(range(first_block + per, first_block + 2 * per))
    other = list(range(first_block + 3 * per - 1, first_block + 2 * per - 1, -1))
    # dynamo traces a frame's first graph with every size static and makes a size symbolic once a later trace
    # differs in it (automatic dynamic): this one serves its own length alone, and the ones after it every length.
    layouts = [ForwardBatch([[0] * (SHORT - 1)], [0], [prompt], [1])]
    for n in (SHORT, LONG):
        for start in (0, CONTEXT):  # fresh (attends to its own tokens alone) or after a cached prefix
            layouts += [
                ForwardBatch([[0] * n], [start], [prompt], [1]),
                ForwardBatch([[0], [0], [0] * n], [CONTEXT, CONTEXT // 2, start], [one, other, prompt], [1, 1, 1]),
            ]
    verify = k_max + 1
    layouts += [
        ForwardBatch([[0], [0] * SHORT], [CONTEXT, 0], [one, prompt], [1, 1]),  # one decoder: a span
        ForwardBatch([[0] * verify, [0] * verify, [0] * SHORT], [CONTEXT, CONTEXT // 2, 0], [one, other, prompt],
                     [verify, verify, 1]),
        ForwardBatch([[0] * verify, [0] * verify, [0] * LONG], [CONTEXT, CONTEXT // 2, 0], [one, other, prompt],
                     [verify, verify, 1]),
    ]
    # Sequences verifying unequal numbers of drafts are padded to one query length (another graph): the goodput
    # controller's usual step. A prompt arriving beside them ran eagerly (17 of 26 such steps of prose at 8
    # concurrent, benchmarks/steady_state.py): 37-43 ms a step, 27-34 ms with these graphs.
    for n in (SHORT, LONG):
        for start in (0, CONTEXT):
            layouts.append(ForwardBatch([[0] * verify, [0], [0] * n], [CONTEXT, CONTEXT // 2, start],
                                        [one, other, prompt], [verify, 1, 1]))
    return layouts
