"""Incremental detokenization and stop strings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decodes one token at a time without ever emitting half a multi-byte character: text is
    released only once a decoded window no longer ends in U+FFFD. Decoding a short window that
    starts a few tokens back keeps leading-space handling of byte-level BPE right.

    Where the tokenizer is a fast one that cleans up no spaces (the decode is then its Rust
    tokenizer's alone), the tokenizers library's own ``DecodeStream`` does the same per token in Rust:
    0.8 us a token against 4.9 for the two Python-level decodes (the embedded pair's tokenizer), about
    0.3 ms of a 64-sequence decode step. The windows stay tracked, for ``flush``."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-6:])  # context only; never emitted
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        backend = getattr(tokenizer, "_tokenizer", None)
        self._stream: tuple[Any, Any] | None = None
        if isinstance(backend, Tokenizer) and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
            self._stream = (DecodeStream(ids=list(self.ids), skip_special_tokens=True), backend)

    def _pending(self) -> tuple[str, str]:
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
        return prefix, full

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self._stream is not None:
            stream, backend = self._stream
            text = stream.step(backend, token_id)
            if text:
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text or ""
        prefix, full = self._pending()
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """The text of tokens held back for an incomplete character, as the tokenizer renders them
        (U+FFFD for the incomplete bytes): at the end there is nothing left to complete it."""
        prefix, full = self._pending()
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]


@dataclass
class TextState:
    """One request's output text: the detokenizer, the text so far (a stop string already cut) and
    how much of it has been handed out in deltas. ``skip``: characters of decoded text still to drop
    before the output begins, the prompt text that token healing re-generates (engine.structured.healing),
    so it is never shown again and no stop string matches inside it."""

    detok: IncrementalDetokenizer | None = None
    text: str = ""
    released: int = 0
    skip: int = 0

    def add(self, decoded: str) -> str:
        """Append newly decoded text; returns the part that is output (the rest was the healed prompt text)."""
        cut = min(self.skip, len(decoded))
        self.skip -= cut
        self.text += decoded[cut:]
        return decoded[cut:]


def find_stop(text: str, stops: tuple[str, ...], new_chars: int) -> tuple[int, str] | None:
    """Earliest stop string that ends within the last ``new_chars`` characters: (index, stop). Each
    string gets its own window: an older occurrence of a short one (say, one produced while min_tokens
    suppressed stops) must not be found through the window a longer one needs."""
    found: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
        if i != -1 and (found is None or i < found[0]):
            found = (i, s)
    return found


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters could still grow into a stop string (so must not be streamed)."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return hold
