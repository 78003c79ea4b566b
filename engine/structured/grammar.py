"""The grammar engine: llguidance compiles a Constraint against the tokenizer, keeps one matcher per
request, and computes the batch's token masks.

Invariant: a request's matcher has consumed exactly its generated tokens (``seq.output_token_ids``).
Drafting and verification walk it over proposed tokens and always roll it back before they return;
only the scheduler's append advances it for good. So a rejected draft never leaves a trace in it."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence as Seq
from typing import Any

import torch

from engine.types.constraint import Constraint
from engine.types.errors import SamplingParamError


class GrammarState:
    """One request's matcher."""

    def __init__(self, matcher: Any, backend: GrammarBackend) -> None:
        self.matcher = matcher
        self.backend = backend  # for the batch's masks: whoever holds a sequence can reach them

    def advance(self, token: int) -> None:
        """Consume one emitted token. A token the mask allowed is always accepted; anything else is a bug."""
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar rejected emitted token {token}: {self.matcher.get_error()}")

    @property
    def lifted(self) -> bool:
        """The constraint no longer applies, so the request goes on without it (engine.structured.healing);
        a request's own grammar holds to the end."""
        return False

    def limit(self, tokens: list[int]) -> list[int] | None:
        """The part of a walk over ``tokens`` that this state masks: the rows after it stay all ones. None:
        not even the current row (a constraint lifted part-way through proposed tokens)."""
        return tokens

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more: the output ends here."""
        return bool(self.matcher.is_stopped())

    def forced(self) -> list[int]:
        """The tokens the grammar allows as the only continuation from here (possibly none)."""
        return list(self.matcher.compute_ff_tokens())

    def valid_prefix(self, tokens: Seq[int]) -> int:
        """How many leading ``tokens`` the grammar allows (the matcher does not move)."""
        return int(self.matcher.validate_tokens(list(tokens))) if tokens else 0

    def push(self, tokens: Seq[int]) -> None:
        """Walk over proposed tokens (they must be valid: ``valid_prefix``); undo with ``pop``."""
        if tokens and not self.matcher.consume_tokens(list(tokens)):
            raise RuntimeError(f"the grammar rejected a proposed token: {self.matcher.get_error()}")

    def pop(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)


class GrammarBackend:
    """Per engine: the tokenizer as llguidance sees it (``vocab`` columns: ids the tokenizer lacks, such as
    a checkpoint's padding rows, are never allowed), a cache of compiled grammars, and a thread pool."""

    def __init__(self, tokenizer: Any, vocab: int, eos_ids: tuple[int, ...], parallel: bool = False) -> None:
        import llguidance
        import llguidance.hf

        self.vocab = vocab
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=list(eos_ids))
        # llguidance's pool spreads a batch's masks over threads; its idle threads spin, and on a CPU host
        # they take cores from the model's own threads (measured: steps several times slower on 2 cores),
        # so there the masks are computed in this thread. On a GPU host the CPU is otherwise idle.
        self.executor = llguidance.LLExecutor() if parallel else None
        self.parallel_from = 4  # walks: below this, the pool's hand-off costs more than it saves
        self._llg = llguidance
        self.compile_seconds: list[float] = []  # drained into the step's stats
        self.mask_seconds = 0.0  # likewise: time spent computing masks

    @functools.lru_cache(maxsize=256)  # noqa: B019 (one backend per engine: the cache lives as long as it)
    def grammar(self, constraint: Constraint) -> str:
        """The constraint's grammar, checked against this tokenizer; SamplingParamError names its field."""
        text = constraint.grammar_text()
        error = self._llg.LLMatcher.validate_grammar(text, self.tokenizer)
        if error:
            raise SamplingParamError(constraint.param, f"invalid {constraint.kind.value}: {error.strip()}")
        return text

    def start(self, constraint: Constraint) -> GrammarState:
        t0 = time.perf_counter()
        matcher = self._llg.LLMatcher(self.tokenizer, self.grammar(constraint), log_level=0)
        if matcher.is_error():
            raise SamplingParamError(constraint.param, f"invalid {constraint.kind.value}: {matcher.get_error()}")
        self.compile_seconds.append(time.perf_counter() - t0)
        return GrammarState(matcher, self)

    def masks(self, rows: int, walks: list[tuple[GrammarState, int, list[int]]]) -> torch.Tensor:
        """Bit masks of allowed tokens, [rows, ceil(vocab / 32)] int32 on the host, all ones where no walk
        writes. A walk (state, row, tokens) fills row ``row`` with the mask at the state's position and
        rows ``row + 1 ..`` with the masks after each of ``tokens`` (which must all be valid): the rows of
        one sequence's verification. The whole batch in one call, spread over llguidance's threads."""
        t0 = time.perf_counter()
        walks = [(w, row, cut) for w, row, tokens in walks if (cut := w.limit(list(tokens))) is not None]
        bitmask = torch.full((rows, (self.vocab + 31) // 32), -1, dtype=torch.int32)
        ptr, width = bitmask.data_ptr(), bitmask.shape[1] * 4
        if self.executor is not None and len(walks) >= self.parallel_from:
            # llguidance takes walks without tokens only through its plain call.
            if plain := [(w.matcher, row) for w, row, tokens in walks if not tokens]:
                self.executor.unsafe_compute_mask_ptr(plain, ptr, width, rows)
            if drafted := [(w.matcher, row, list(tokens)) for w, row, tokens in walks if tokens]:
                self.executor.unsafe_compute_mask_ptr_with_draft_token(drafted, ptr, width, rows)
        else:
            for w, row, tokens in walks:
                w.matcher.unsafe_compute_mask_ptr(ptr + row * width, width)
                for i, token in enumerate(tokens):
                    w.push([token])
                    w.matcher.unsafe_compute_mask_ptr(ptr + (row + i + 1) * width, width)
                w.pop(len(tokens))
        self.mask_seconds += time.perf_counter() - t0
        return bitmask


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens get -inf: the masked distribution is the target's renormalised over what the
    grammar allows. logits [R, V], bitmask [M, W] int32 (host) for the logits rows ``rows`` [M] ->
    [R, V] (a new tensor)."""
    R, V = logits.shape
    bits = torch.arange(32, dtype=torch.int32)  # [32]
    allowed = ((bitmask[:, :, None] >> bits) & 1).view(bitmask.shape[0], -1)[:, :V].bool()  # [M, V]
    logits = logits.clone()
    rows = rows.to(logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed.to(logits.device), float("-inf"))
    return logits
