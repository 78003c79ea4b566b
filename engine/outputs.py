"""What the engine hands back: per-step deltas, and finished completions for the offline API."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import TokenLogprob


@dataclass(frozen=True)
class RequestOutput:
    """One request's progress in one step: only what is new, so streaming costs O(new tokens)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int


@dataclass
class CompletionOutput:
    """A whole completion, accumulated from its RequestOutputs."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.token_ids.extend(out.new_token_ids)
        self.text += out.new_text
        self.logprobs.extend(out.new_logprobs)
        self.finish_reason = out.finish_reason
        self.stop_reason = out.stop_reason
        # Cumulative counts; max() so that an output made up for an abort (zeros) cannot lower them.
        self.num_draft_tokens = max(self.num_draft_tokens, out.num_draft_tokens)
        self.num_accepted_tokens = max(self.num_accepted_tokens, out.num_accepted_tokens)
