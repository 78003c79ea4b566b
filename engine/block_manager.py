"""Fixed-size KV blocks handed out from a free list. Pure Python: no torch."""

from __future__ import annotations

from collections import deque

from engine.sequence import Sequence


class BlockManager:
    """Owns which cache blocks are free. A sequence's ``block_table`` lists its blocks in order;
    token position ``p`` lives in block ``block_table[p // block_size]`` at offset ``p % block_size``.

    Blocks are never shrunk while a sequence lives: capacity reserved for drafts that were rejected
    stays with it and is reused by later tokens.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks ``seq`` needs so that positions ``[0, num_tokens)`` have slots."""
        want = -(-num_tokens // self.block_size)
        return max(0, want - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {need}, have {len(self._free)}")
        seq.block_table.extend(self._free.popleft() for _ in range(need))

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table = []
