"""Fixed-size KV blocks: a free list, and a prefix cache of full blocks keyed by their tokens. No torch."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from engine.types.sequence import Sequence

ROOT = b""  # the parent of a sequence's first block


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    """A block's identity: its tokens and, through ``parent``, every token before them. K/V at a
    position depend on the whole prefix, so two blocks with equal hashes hold equal K/V. A
    cryptographic hash, because a collision would hand one request another's cache contents."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockManager:
    """Owns which cache blocks are free. A sequence's ``block_table`` lists its blocks in order;
    token position ``p`` lives in block ``block_table[p // block_size]`` at offset ``p % block_size``.

    Blocks are never shrunk while a sequence lives: capacity reserved for drafts that were rejected
    stays with it and is reused by later tokens.

    Prefix caching: once every position of a block holds K/V of final tokens (below
    ``seq.num_computed``), the block is registered under its chain hash. A new sequence starts from
    the longest chain of registered blocks matching its tokens and computes only the rest. Blocks are
    reference-counted; a registered block nobody holds stays cached and is evicted, least recently
    released first, only when no never-used block is left. Nothing ever writes a registered block:
    the target writes at positions >= ``num_computed``, which lie past every full computed block.

    The draft model's cache uses the same block ids, so a block's draft K/V is valid only if some
    sequence's draft model computed it: registered blocks carry that as a flag, and a sequence that
    reuses blocks starts its draft cache at the first block without it (the rest is catch-up).
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: deque[int] = deque(range(num_blocks))  # hold nothing worth keeping
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # registered block -> its chain hash
        self._block_of: dict[bytes, int] = {}  # chain hash -> registered block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, unreferenced; oldest first
        self._draft_valid: set[int] = set()  # registered blocks whose draft-cache K/V is valid too

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never used, or cached but held by no sequence."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_of)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences, in [0, 1] (cached blocks nobody holds count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def refs(self, block: int) -> int:
        return self._refs[block]

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks ``seq`` needs so that positions ``[0, num_tokens)`` have slots."""
        want = -(-num_tokens // self.block_size)
        return max(0, want - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {need}, have {self.num_free_blocks}")
        seq.block_table.extend(self._take() for _ in range(need))

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:  # evict the least recently released cached block
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
            self._draft_valid.discard(block)
        self._refs[block] = 1
        return block

    def free(self, seq: Sequence) -> None:
        # Tail first, so that a chain's tail is evicted before its head (a tail without its head can
        # never be matched again).
        for block in reversed(seq.block_table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        seq.block_table = []
        seq.prefix.registered = seq.prefix.draft_registered = 0

    # ---- prefix caching -------------------------------------------------------------------------

    def hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chain hashes of the sequence's first ``num_blocks`` full blocks (memoised on it: its
        token ids only ever grow, and drafts are never among them)."""
        known, bs = seq.prefix.hashes, self.block_size
        for i in range(len(known), num_blocks):
            known.append(chain_hash(known[-1] if known else ROOT, seq.token_ids[i * bs : (i + 1) * bs]))
        return known[:num_blocks]

    def match(self, seq: Sequence) -> list[int]:
        """The registered blocks that hold the longest cached prefix of a sequence with no blocks.
        At least its last token is left out, since the step that follows must compute something to
        sample from (and must not write into a shared block to do it)."""
        if not self.prefix_caching or seq.block_table or seq.params.prompt_logprobs is not None:
            return []  # prompt logprobs need the logits of every prompt position, which no cached block holds
        hit = []
        for h in self.hashes(seq, (seq.num_tokens - 1) // self.block_size):
            block = self._block_of.get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def can_reuse(self, seq: Sequence, hit: list[int], num_tokens: int) -> bool:
        """Whether ``seq`` can hold ``hit`` and then grow to ``num_tokens`` positions."""
        need = -(-num_tokens // self.block_size) - len(hit)
        unheld = sum(1 for b in hit if self._refs[b] == 0)  # taking them uses up evictable blocks
        return need <= self.num_free_blocks - unheld

    def reuse(self, seq: Sequence, hit: list[int]) -> None:
        """Give a sequence with no blocks the cached prefix ``hit``: its target cache is computed that
        far, its draft cache as far as the leading blocks whose draft K/V is valid."""
        assert not seq.block_table, "only a sequence without blocks can start from the cache"
        for block in hit:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        seq.block_table = list(hit)
        draft = next((i for i, b in enumerate(hit) if b not in self._draft_valid), len(hit))
        seq.num_computed = len(hit) * self.block_size
        seq.draft_num_computed = draft * self.block_size
        seq.prefix.registered = len(hit)
        seq.prefix.draft_registered = draft

    def register(self, seq: Sequence) -> None:
        """After a step: register the sequence's newly full, computed blocks, and flag those its draft
        model has computed too. A block whose prefix another block already holds stays private."""
        if not self.prefix_caching:
            return
        bs, p = self.block_size, seq.prefix
        full = seq.num_computed // bs
        if full > p.registered:
            hashes = self.hashes(seq, full)
            for i in range(p.registered, full):
                block = seq.block_table[i]
                if block not in self._hash_of and hashes[i] not in self._block_of:
                    self._hash_of[block] = hashes[i]
                    self._block_of[hashes[i]] = block
            p.registered = full
        draft_full = min(seq.draft_num_computed, seq.num_computed) // bs
        for i in range(p.draft_registered, draft_full):
            block = seq.block_table[i]
            if self._hash_of.get(block) == p.hashes[i]:
                self._draft_valid.add(block)
        p.draft_registered = max(p.draft_registered, draft_full)

    def filling(self, seq: Sequence) -> list[bytes]:
        """Hashes of the full prompt blocks a sequence is still computing: a waiting sequence whose
        next block is among them waits a step and reuses them instead of computing them twice
        (``n > 1`` choices, or one prompt sent twice at once)."""
        start, end = seq.num_computed // self.block_size, (seq.num_tokens - 1) // self.block_size
        if not self.prefix_caching or start >= end:
            return []
        return self.hashes(seq, end)[start:end]
