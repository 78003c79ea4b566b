"""What the engine hands back: per-step deltas, and finished completions for the offline API."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.types.sequence import Sequence, SourceTokens, TokenLogprob


@dataclass(frozen=True)
class Verdict:
    """One sampling sequence's verified step: the tokens it emits (accepted drafts, then the recovered
    or bonus token), before any stop condition cuts them, with the target's logprobs where asked."""

    tokens: list[int]
    num_drafts: int = 0
    num_accepted: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None  # this sequence alone failed (non-finite logits)


@dataclass(frozen=True)
class RequestOutput:
    """One request's progress in one step: only what is new, so streaming costs O(new tokens)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" once finished
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens whose K/V the prefix cache held when the request was admitted
    num_output_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    spec_by_source: dict[str, SourceTokens] = field(default_factory=dict)  # the two above, by draft source name
    # With params.prompt_logprobs, in the request's first output: one per prompt token, the first None.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @classmethod
    def of(cls, seq: Sequence, tokens: list[int], text: str, logprobs: list[TokenLogprob]) -> RequestOutput:
        prompt = None
        if seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            prompt = [None, *seq.prompt_logprobs][: seq.num_prompt_tokens]
            seq.prompt_logprobs_sent = True  # once per request: the outputs carry only what is new
        return cls(
            request_id=seq.request_id,
            new_token_ids=tokens,
            new_text=text,
            new_logprobs=logprobs,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            stop_reason=seq.stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens + seq.num_healed_tokens,  # the prompt the client sent
            num_cached_tokens=seq.prefix.cached_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_draft_tokens=seq.num_draft_tokens,
            num_accepted_tokens=seq.num_accepted_tokens,
            spec_by_source=dict(seq.spec_by_source),  # a snapshot: the sequence's own dict goes on changing
            prompt_logprobs=prompt,
        )


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
    num_cached_tokens: int = 0
    spec_by_source: dict[str, SourceTokens] = field(default_factory=dict)  # drafted and accepted, by draft source
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.token_ids.extend(out.new_token_ids)
        self.text += out.new_text
        self.logprobs.extend(out.new_logprobs)
        self.finish_reason = out.finish_reason
        self.stop_reason = out.stop_reason
        # Cumulative counts; max() so that an output made up for an abort (zeros) cannot lower them.
        self.num_draft_tokens = max(self.num_draft_tokens, out.num_draft_tokens)
        self.num_accepted_tokens = max(self.num_accepted_tokens, out.num_accepted_tokens)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        for name, got in out.spec_by_source.items():
            had = self.spec_by_source.get(name, SourceTokens())
            self.spec_by_source[name] = SourceTokens(max(had.num_draft_tokens, got.num_draft_tokens),
                                                     max(had.num_accepted_tokens, got.num_accepted_tokens))
