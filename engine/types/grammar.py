"""What the engine asks of a structured request's matcher through its Sequence. The one implementation is
engine.structured.grammar.GrammarState (llguidance); the sequence holds it by this face so that plain data
does not import the grammar engine."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol


class Grammar(Protocol):
    def advance(self, token: int) -> None: ...

    @property
    def lifted(self) -> bool: ...

    def limit(self, tokens: list[int]) -> list[int] | None: ...

    @property
    def finished(self) -> bool: ...

    def forced(self) -> list[int]: ...

    def valid_prefix(self, tokens: Seq[int]) -> int: ...

    def push(self, tokens: Seq[int]) -> None: ...

    def pop(self, n: int) -> None: ...
