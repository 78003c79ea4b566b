"""Token strings and bytes for logprobs, in the completions (legacy) and chat formats."""

from __future__ import annotations

import codecs
import functools
import re
from typing import Any

from engine import TokenLogprob
from server.responses import ChatLogprobs, CompletionLogprobs, PromptLogprob, TokenLogprobEntry, TopLogprob

_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # sentencepiece byte-fallback tokens


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable character table, inverted: how byte-level BPE spells raw bytes."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _is_byte_level(tokenizer: Any) -> bool:
    try:
        from tokenizers import decoders

        return isinstance(tokenizer.backend_tokenizer.decoder, decoders.ByteLevel)
    except (AttributeError, ImportError):
        return False


class TokenText:
    """A token's exact bytes, and its text as OpenAI shows it: the UTF-8 string, or ``bytes:\\xNN``
    for a token that is only part of a character. Without a tokenizer: ``token_id:N``."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.byte_level = tokenizer is not None and _is_byte_level(tokenizer)
        self._cache: dict[int, tuple[str, bytes]] = {}  # bounded by the vocabulary

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def text(self, token_id: int) -> str:
        return self(token_id)[0]

    def _compute(self, token_id: int) -> tuple[str, bytes]:
        tok = self.tokenizer
        if tok is None:  # no text at all: token ids only
            return f"token_id:{token_id}", b""
        raw = tok.convert_ids_to_tokens(token_id)
        table = _byte_level_decoder()
        if raw is None:  # an id past the tokenizer's entries (a padding row of the embedding)
            return f"token_id:{token_id}", b""
        if self.byte_level and all(c in table for c in raw):
            data = bytes(table[c] for c in raw)
        elif m := _SP_BYTE.match(raw):
            data = bytes([int(m.group(1), 16)])
        elif raw.startswith("▁"):  # sentencepiece word start; decode() of one token would drop the space
            data = (" " + tok.decode([token_id]).lstrip()).encode()
        else:
            data = tok.decode([token_id]).encode()
        try:
            return data.decode("utf-8"), data
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data), data


class TextOffsets:
    """Character offsets of successive tokens in the text: a token that ends inside a character
    advances nothing until the character is complete, as in the text itself."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.offset = 0

    def advance(self, data: bytes) -> int:
        start = self.offset
        self.offset += len(self._decoder.decode(data))
        return start


def completion_logprobs(
    text: TokenText, entries: list[TokenLogprob], offsets: TextOffsets, prompt_ids: list[int] | None = None,
    prompt_scores: list[TokenLogprob | None] | None = None,
) -> CompletionLogprobs:
    """The legacy format. Echoed prompt tokens come first, scored by the target (``prompt_scores``, one per prompt
    token); the first has no context, so its logprob and top are null, as OpenAI's and vLLM's are."""
    out = CompletionLogprobs()
    for i, token_id in enumerate(prompt_ids or []):
        s, b = text(token_id)
        scored = prompt_scores[i] if prompt_scores is not None and i < len(prompt_scores) else None
        out.tokens.append(s)
        out.token_logprobs.append(scored.logprob if scored else None)
        out.top_logprobs.append(_top(text, scored) if scored else None)
        out.text_offset.append(offsets.advance(b))
    for e in entries:
        s, b = text(e.token_id)
        out.tokens.append(s)
        out.token_logprobs.append(e.logprob)
        out.top_logprobs.append(_top(text, e))
        out.text_offset.append(offsets.advance(b))
    return out


def _top(text: TokenText, e: TokenLogprob) -> dict[str, float]:
    top: dict[str, float] = {}
    for t, lp in e.top:  # best first: where two ids print alike, keep the likelier
        top.setdefault(text.text(t), lp)
    return top


def vllm_prompt_logprobs(
    text: TokenText, prompt_ids: list[int], scores: list[TokenLogprob | None]
) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else token id -> logprob, rank and decoded
    token, for the prompt's own token and its top-N alternatives."""
    out: list[dict[str, PromptLogprob] | None] = []
    for token_id, e in zip(prompt_ids, scores):
        if e is None:
            out.append(None)
            continue
        entry = {str(token_id): PromptLogprob(logprob=e.logprob, rank=e.rank, decoded_token=text.text(token_id))}
        for rank, (t, lp) in enumerate(e.top, start=1):
            entry.setdefault(str(t), PromptLogprob(logprob=lp, rank=rank, decoded_token=text.text(t)))
        out.append(entry)
    return out


def chat_logprobs(text: TokenText, entries: list[TokenLogprob]) -> ChatLogprobs:
    content = []
    for e in entries:
        s, b = text(e.token_id)
        top = [TopLogprob(token=text(t)[0], logprob=lp, bytes=list(text(t)[1])) for t, lp in e.top]
        content.append(TokenLogprobEntry(token=s, logprob=e.logprob, bytes=list(b), top_logprobs=top))
    return ChatLogprobs(content=content)
