"""One packed forward's inputs: which tokens each sequence feeds, from where, and which rows need logits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.layers.attention_metadata import SHORT_QUERY
from engine.types.schedule import ScheduledSeq


@dataclass(frozen=True)
class ForwardBatch:
    """One packed forward: sequence i feeds ``token_ids[i]`` at positions ``[starts[i], ...)``."""

    token_ids: list[list[int]]
    starts: list[int]
    block_tables: list[list[int]]
    logits_rows: list[int]  # per sequence: how many trailing positions need logits (0 = none)
    # The tokens as a [T] tensor already on the device (a draft loop's previous output): token_ids then
    # only say how many tokens each sequence feeds, and nothing is copied from the host.
    input_ids: torch.Tensor | None = None

    def ids(self, device: torch.device) -> torch.Tensor:
        """The fed tokens as [1, T] on ``device``."""
        if self.input_ids is not None:
            return self.input_ids.view(1, -1)
        return torch.tensor([[t for toks in self.token_ids for t in toks]], dtype=torch.long, device=device)

    def parts(self) -> list[list[int]]:
        """The sequences' indices in the parts a mix of prompt chunks and short queries runs in where no graph
        serves it whole: the short queries together first, then each prompt chunk alone (empty: not a mix)."""
        long = [i for i, toks in enumerate(self.token_ids) if len(toks) > SHORT_QUERY]  # none in a decode step
        if not long or len(long) == len(self.token_ids):
            return []
        return [[i for i, toks in enumerate(self.token_ids) if len(toks) <= SHORT_QUERY]] + [[i] for i in long]

    def part(self, seqs: list[int]) -> ForwardBatch:
        return ForwardBatch([self.token_ids[i] for i in seqs], [self.starts[i] for i in seqs],
                            [self.block_tables[i] for i in seqs], [self.logits_rows[i] for i in seqs])

    def logits_row_index(self) -> tuple[list[int], int]:
        """The packed rows that need logits, in order, and the number of rows T."""
        keep, end = [], 0
        for toks, r in zip(self.token_ids, self.logits_rows):
            end += len(toks)
            keep.extend(range(end - r, end))
        return keep, end


class Announcer(Protocol):
    """Told of every forward of a runner before it runs (engine.parallel.mirror.Leader: the other ranks run it)."""

    def forward(self, batch: ForwardBatch) -> None: ...


def prompt_rows(s: ScheduledSeq) -> int:
    """Positions of this step whose logits score a prompt token (those before the prompt's last), where the
    request asked for prompt logprobs: they lead the sequence's logits rows."""
    seq = s.seq
    if seq.params.prompt_logprobs is None:
        return 0
    return max(0, min(seq.num_computed + s.num_new_tokens, seq.num_prompt_tokens - 1) - seq.num_computed)


def logits_rows(s: ScheduledSeq, drafts: list[int]) -> tuple[int, int, int]:
    """A sequence's logits rows this step, in order: (prompt rows, padding, sampling rows). Rows are always a
    feed's trailing positions, so a chunk that ends the prompt of a request scoring it alone (max_tokens 0) takes
    its last position's row too, as padding nobody reads."""
    prompt, sampling = prompt_rows(s), (len(drafts) + 1 if s.samples else 0)
    ends = s.seq.num_computed + s.num_new_tokens == s.seq.num_tokens
    return prompt, int(prompt > 0 and not sampling and ends), sampling


def step_batch(scheduled: list[ScheduledSeq], drafts: list[list[int]]) -> ForwardBatch:
    """The step's one target pass: each sequence's uncomputed tokens plus its drafts. Sequences that
    reach their last known token get logits for it and every draft position; a prompt chunk of a
    request that asked for prompt logprobs gets them for every position (prompt_rows), before those."""
    feeds, rows = [], []
    for s, d in zip(scheduled, drafts):
        seq = s.seq
        feeds.append(seq.token_ids[seq.num_computed : seq.num_computed + s.num_new_tokens] + d)
        if seq.params.prompt_logprobs is None:  # the decode loop's case: half the cost of logits_rows
            rows.append(len(d) + 1 if s.samples else 0)
        else:
            rows.append(sum(logits_rows(s, d)))
    return ForwardBatch(feeds, [s.seq.num_computed for s in scheduled], [s.seq.block_table for s in scheduled], rows)
