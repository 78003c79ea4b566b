"""One packed forward's inputs: which tokens each sequence feeds, from where, and which rows need logits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.layers.attention_metadata import SHORT_QUERY
from engine.layers.small_linear import SMALL_ROWS
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
        """The sequences' indices in the parts a forward runs in where no graph serves it whole (empty: none). A
        mix of prompt chunks and short queries: the short queries together first, then each prompt chunk alone.
        Prompts alone: each past SMALL_ROWS tokens by itself, the others together, where two or more are past it
        (``apart``)."""
        long = [i for i, toks in enumerate(self.token_ids) if len(toks) > SHORT_QUERY]  # none in a decode step
        if not long:
            return []
        if len(long) == len(self.token_ids):
            return self.apart()
        return [[i for i, toks in enumerate(self.token_ids) if len(toks) <= SHORT_QUERY]] + [[i] for i in long]

    def apart(self) -> list[list[int]]:
        """Prompt chunks alone, in the parts they run in: each past SMALL_ROWS tokens in a prompt graph of its
        own, the shorter ones together in one forward; empty where fewer than two are past it. A graph puts a
        product past SMALL_ROWS rows on oneDNN with the weight packed at load, an eager forward on MKL's sgemm,
        which runs below this CPU's peak. The embedded target on 2 CPU cores, one forward against one graph a
        prompt: 3 prompts of 140 tokens 82 -> 66 ms, 3 of 320 196 -> 156, 4 of 1000 886 -> 735; at 120 tokens
        and fewer (the few-rows kernel's rows, which a fused eager product over many prompts matches) 4 of 120
        84 -> 83, 8 of 60 97 -> 101 and 16 of 30 67 -> 127, so those stay together."""
        big = [i for i, toks in enumerate(self.token_ids) if len(toks) > SMALL_ROWS]
        if len(big) < 2:
            return []
        rest = [i for i, toks in enumerate(self.token_ids) if len(toks) <= SMALL_ROWS]
        return [[i] for i in big] + ([rest] if rest else [])

    @property
    def mixed(self) -> bool:
        """Prompt chunks beside short queries (decoding or verifying sequences)."""
        short = [len(toks) <= SHORT_QUERY for toks in self.token_ids]
        return any(short) and not all(short)

    def with_logits_rows(self, rows: int) -> ForwardBatch:
        """The same forward with ``rows`` rows of logits from every sequence."""
        return ForwardBatch(self.token_ids, self.starts, self.block_tables, [rows] * len(self.token_ids),
                            self.input_ids)

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
