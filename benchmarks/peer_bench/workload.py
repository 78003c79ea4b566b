"""What a prompt set hands the client: plain prompts, prompts with extra request fields, conversations."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Request:
    """One completion request: the prompt and the body fields beside it (e.g. response_format)."""

    prompt: str
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Conversation:
    """Requests generated from earlier responses: turn 1 sends ``first``; every later turn resends the
    previous turn's prompt and the model's output to it, then ``follow_up``. A turn needs the previous
    one's output, so the turns of one conversation run in order (conversations run side by side)."""

    first: str
    turns: int
    follow_up: str

    def next_prompt(self, prompt: str, output: str) -> str:
        return prompt + output + self.follow_up


Item = str | Request | Conversation


def as_request(item: str | Request) -> Request:
    return item if isinstance(item, Request) else Request(item)


def requests_in(item: Item) -> int:
    return item.turns if isinstance(item, Conversation) else 1


def needs_server(item: Item) -> bool:
    """Whether the item uses request fields that generate() cannot take (e.g. response_format)."""
    return isinstance(item, Request) and bool(item.extra)
