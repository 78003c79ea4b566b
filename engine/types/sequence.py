"""One request's decoding state. No torch: the scheduler tests run in milliseconds."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from engine.types.detokenizer import TextState
from engine.types.draft_state import DraftState
from engine.types.grammar import Grammar
from engine.types.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"
    ERROR = "error"  # this request alone failed (non-finite logits, a detokenizer error); the batch went on


@dataclass(frozen=True)
class TokenLogprob:
    """The emitted token's log-probability under the target, and the top-N alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int | None = None  # 1 + how many tokens the target scored higher (prompt logprobs carry it)


@dataclass(frozen=True)
class AuditCase:
    """What a losslessness audit re-runs: the request it checks and the tokens that request produced."""

    request_id: str
    output: tuple[int, ...]


@dataclass(frozen=True)
class SourceTokens:
    """One draft source's part of a request's drafts (engine.types.stats.shares decides which are whose)."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def plus(self, drafted: int, accepted: int) -> SourceTokens:
        return SourceTokens(self.num_draft_tokens + drafted, self.num_accepted_tokens + accepted)


@dataclass
class PrefixState:
    """What the prefix cache knows of one sequence (engine.sched.block_manager)."""

    hashes: list[bytes] = field(default_factory=list)  # chain hashes of its full blocks of tokens, memoised
    registered: int = 0  # leading blocks of its table that are in the cache (or were found to be duplicates)
    draft_registered: int = 0  # leading blocks checked for draft-cache validity
    cached_tokens: int = 0  # prompt tokens its first admission found in the cache


@dataclass(eq=False)  # identity, not field-by-field: the scheduler searches lists of these
class Sequence:
    """Token accounting follows one rule: ``token_ids[:num_computed]`` have valid K/V in the
    target's cache; a step feeds ``token_ids[num_computed:]`` plus drafts. Rejected drafts are
    forgotten by lowering a length, never by copying."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    key: int = 0  # keys every random draw this request makes (engine.sample.rng)
    num_prompt_tokens: int = 0
    num_healed_tokens: int = 0  # prompt tokens token healing backed off (engine.structured.healing): still the client's
    num_computed: int = 0
    draft_num_computed: int = 0  # the draft model's own cache, kept in step with the target's
    # An EAGLE head's input rows for positions [draft_num_computed, num_computed): the target's fused hidden
    # states, waiting for the head's next catch-up (engine.speculative.eagle); a torch tensor, typed loosely here.
    draft_hidden: Any = None
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # With params.prompt_logprobs: entry i scores prompt token i + 1, appended as the prefill computes it.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    spec_by_source: dict[str, SourceTokens] = field(default_factory=dict)  # the two above, by draft source name
    num_preemptions: int = 0
    text: TextState = field(default_factory=TextState)
    draft: DraftState = field(default_factory=DraftState)
    prefix: PrefixState = field(default_factory=PrefixState)
    # engine.sample.sampling.generated_counts' cache, for penalties (no torch here)
    generated_counts: object | None = None
    grammar: Grammar | None = None  # the matcher of a structured request (engine.structured)
    audit: AuditCase | None = None  # set on an audit's own sequence, which runs in the background

    @property
    def background(self) -> bool:
        """Runs only when no client request waits."""
        return self.audit is not None

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_decoding(self) -> bool:
        """Only the last token lacks K/V: the next step samples (and may verify drafts)."""
        return self.num_uncomputed == 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def reset_for_recompute(self) -> None:
        """Preemption: the blocks are gone, so every token must be recomputed later."""
        self.num_computed = 0
        self.draft_num_computed = 0
        self.draft_hidden = None
        self.block_table = []
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1
