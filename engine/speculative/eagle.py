"""EAGLE-3 drafting: a one-layer head reads the target's own hidden states and drafts a chain of tokens.

The head's K/V live in a one-layer paged cache addressed through the target's block tables (as the draft
model's do), and ``seq.draft_num_computed`` says how far they are valid. Its K/V at position t are a
function of the target's hidden states at t and token t + 1, so the head follows the target: after every
target forward the fused hidden states of the positions the step kept wait on the sequence
(``seq.draft_hidden``, rows for positions from ``draft_num_computed``), and the next drafting forward
consumes them, the last of them (the target's last computed position) giving the first draft. Chain steps
then feed the head's own output back at the positions past it; their K/V are the head's guesses, never
counted as valid, and the next catch-up overwrites them with the target-fed ones.

A prefix from the prefix cache is the one case where the head cannot catch up: the target never computes
those positions, so their hidden states never exist. The blocks' head K/V are valid where some sequence's
head computed them (the block manager's draft flag, as for a draft model); past those, the head skips to
the first position the target computes and attends to whatever the skipped slots hold. That costs
acceptance only, never correctness (every draft is verified), and a shared prompt's blocks are usually
valid, since the first sequence over them had its head catch up on them. Recomputing the skipped blocks
instead would cost target forwards on every cache hit.
"""

from __future__ import annotations

from functools import partial

import torch

from engine.layers import attention
from engine.layers.kv_cache import LayerShape, PagedKVCache
from engine.models.eagle_head import Eagle3Head, aux_layer_ids, load_head
from engine.speculative.chain import chain_batch, draft_chain
from engine.speculative.draft_model import DraftModelSource
from engine.speculative.source import DraftRequest, Proposal
from engine.types.schedule import ScheduledSeq
from engine.types.sequence import Sequence
from engine.worker.forward_batch import ForwardBatch
from engine.worker.layout import build_metadata
from engine.worker.model_runner import ModelRunner
from engine.worker.staging import Uploader

# Logits outside the draft vocabulary: finite, so that a row whose grammar allows none of the draft
# vocabulary still has a distribution (uniform over what it allows) rather than NaN.
_OUTSIDE = -1e9


class EagleRunner:
    """The head, its cache, and packed forwards over it (the counterpart of ModelRunner for a head)."""

    def __init__(self, head: Eagle3Head, target: ModelRunner, name: str) -> None:
        attention.register()
        self.device, self.dtype, self.name = target.device, target.dtype, name
        self.upload = Uploader(self.device)
        if head.embed_tokens is None:
            head.share_embeddings(target.model.get_input_embeddings())
        self.head = head.to(self.device, self.dtype)
        self.head.config._attn_implementation = attention.ATTN_IMPL
        attn = self.head.midlayer.self_attn
        self.layer_shapes = [LayerShape(self.head.config.num_key_value_heads, attn.head_dim, attn.head_dim)]
        self.aux_ids = aux_layer_ids(head.config, len(target.layer_shapes))
        self.vocab_size = target.vocab_size
        self.cache: PagedKVCache | None = None
        self.prenorm: torch.Tensor | None = None  # [R, H] the head's pre-norm output at the rows of the last logits

    @classmethod
    def load(cls, path: str, target: ModelRunner) -> EagleRunner:
        config = target.model.config.get_text_config()
        head = load_head(path, config.hidden_size, target.vocab_size, target.model.get_output_embeddings())
        return cls(head, target, f"EAGLE-3 head {path}")

    def bytes_per_block(self, block_size: int) -> int:
        return PagedKVCache.bytes_per_block(self.layer_shapes, block_size, self.dtype)

    def allocate_cache(self, num_blocks: int, block_size: int) -> None:
        self.cache = PagedKVCache(self.layer_shapes, num_blocks, block_size, self.dtype, self.device)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's captured hidden states [T, 3 * H_target] -> the head's input rows [T, H]."""
        return self.head.fuse(aux)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden`` [T, H]: a row per fed token (zeros when None: start-up timing). Returns float32 logits over
        the target's vocabulary ``[sum(logits_rows), V]``, and leaves the pre-norm output of those rows in
        ``self.prenorm``."""
        assert self.cache is not None, "allocate_cache() first"
        ends = [s + len(t) for s, t in zip(batch.starts, batch.token_ids)]
        meta = build_metadata(self.cache, batch.block_tables, batch.starts, ends, self.upload)
        input_ids = batch.ids(self.device)  # [1, T]
        if hidden is None:
            hidden = torch.zeros(input_ids.shape[1], self.head.config.hidden_size, dtype=self.dtype, device=self.device)
        out = self.head(input_ids, hidden.to(self.dtype)[None], meta.positions[None],
                        **{attention.METADATA_KWARG: meta})[0]  # [T, H]
        keep, _ = batch.logits_row_index()
        self.prenorm = out.index_select(0, torch.tensor(keep, dtype=torch.long, device=self.device))  # [R, H]
        logits = self.head.logits(self.prenorm)  # [R, V]
        return logits.clamp(min=_OUTSIDE)


class EagleSource(DraftModelSource):
    name = "eagle"

    def __init__(self, runner: EagleRunner, target: ModelRunner, eos_ids: tuple[int, ...],
                 confidence: float = 0.0) -> None:
        super().__init__(runner, target.vocab_size, eos_ids, confidence)  # type: ignore[arg-type]  # same timing
        self.eagle = runner
        self.target = target

    def lag(self, seq: Sequence) -> int:
        # Positions [draft_num_computed, num_computed) wait for the head; drafting feeds the last of them itself.
        return max(0, seq.num_computed - 1 - seq.draft_num_computed)

    def absorb(self, scheduled: list[ScheduledSeq], starts: list[int], fed: list[int]) -> None:
        """After the target's forward and verification: the fused hidden states of the positions each sequence
        kept (``starts[i]`` was its num_computed before the step, ``fed[i]`` how many rows it fed) join what
        waits for the head."""
        aux = self.target.aux
        assert aux is not None, "the target captures no hidden states"
        fused = self.eagle.fuse(aux)  # [T, H]
        row = 0
        for s, start, n in zip(scheduled, starts, fed):
            seq = s.seq
            kept = min(n, seq.num_computed - start)
            if kept > 0:
                new = fused[row : row + kept]
                waiting = seq.draft_hidden
                if waiting is not None and seq.draft_num_computed + waiting.shape[0] == start:
                    seq.draft_hidden = torch.cat([waiting, new])
                elif waiting is None and seq.draft_num_computed == start:
                    seq.draft_hidden = new
                else:  # a prefix-cache hit the head has no K/V for: skip it (see the module docstring)
                    seq.draft_num_computed, seq.draft_hidden = start, new
            row += n

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        rows: list[int] = []  # the requests behind the last forward's logits rows (and self.eagle.prenorm's)

        def position(j: int, active: list[int], drafted: torch.Tensor) -> torch.Tensor:
            seqs = [requests[i].seq for i in active]
            if j == 0:  # the target-fed positions: catch up, the last of them (when drafting) drafting
                batch, hidden = self._catch_up(requests, active)
            else:  # chain: the previous draft at the next position, with the head's own last output
                batch = chain_batch(seqs, [s.num_computed + j - 1 for s in seqs], drafted, active, j)
                prenorm = self.eagle.prenorm  # [R, H]
                assert prenorm is not None
                at = {i: r for r, i in enumerate(rows)}
                hidden = prenorm[torch.tensor([at[i] for i in active], device=self.eagle.device)]  # [a, H]
            logits = self._timed(batch, partial(self.eagle.forward, hidden=hidden))
            rows[:] = [i for i in active if requests[i].max_drafts]
            return logits

        return draft_chain(requests, position, self.vocab, self.eos_ids, self.eagle.device, self.confidence)

    @staticmethod
    def _catch_up(requests: list[DraftRequest], active: list[int]) -> tuple[ForwardBatch, torch.Tensor]:
        """Position 0: each active row feeds the positions waiting for the head, with their hidden rows
        (consumed from ``seq.draft_hidden``) -> (batch, hidden [T, H])."""
        seqs = [requests[i].seq for i in active]
        starts = [s.draft_num_computed for s in seqs]
        counts = [requests[i].catch_up + (1 if requests[i].max_drafts else 0) for i in active]
        feeds = [s.token_ids[c + 1 : c + 1 + m] for s, c, m in zip(seqs, starts, counts)]
        rows = []
        for s, m in zip(seqs, counts):
            waiting = s.draft_hidden
            assert waiting is not None and waiting.shape[0] >= m, "the head is missing hidden states"
            rows.append(waiting[:m])
            s.draft_hidden = waiting[m:] if waiting.shape[0] > m else None
            s.draft_num_computed += m
        batch = ForwardBatch(feeds, starts, [s.block_table for s in seqs],
                             [1 if requests[i].max_drafts else 0 for i in active])
        return batch, torch.cat(rows)
