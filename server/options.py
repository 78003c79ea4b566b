"""What a server option is. Each ServerConfig field is declared once, with ``option(...)``; its flag, its SPECD_*
variable, its YAML key, its row in docs/configuration.md and, for the engine's options, its EngineConfig keyword are
all derived from that field (server.options_cli, server.options_sources, server.options_docs,
ServerConfig.engine_config).

Why metadata on a frozen dataclass rather than pydantic-settings: the sources sit in an order pydantic-settings does
not have built in (the YAML file between the environment and the flags), the flags have shapes its CLI does not
(``--compile`` alone, ``--no-prefix-caching``, ``adaptive`` for a number), the error messages name the variable, file
or flag a bad value came from, and ServerConfig stays the typed frozen dataclass the rest of server/ reads, without a
new dependency. This module imports nothing heavy: checking flags must not load torch."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "SPECD_"  # SPECD_<OPTION IN CAPITALS> sets any option
TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class ConfigError(ValueError):
    """A configuration the server cannot start with; the message says what to change."""


@dataclass(frozen=True)
class Option:
    help: str  # --help's text and the docs table's "what"
    choices: tuple[str, ...] = ()
    engine: bool = False  # passed on to EngineConfig under the same name
    metavar: str | None = None
    shown_default: str | None = None  # the default as the docs state it, where the bare value would mislead
    bare: str | None = None  # the value of the flag given alone (``--compile`` is ``--compile start``)
    none_words: tuple[str, ...] = ()  # text that stands for None (``adaptive`` for num_speculative_tokens)
    from_yaml: Callable[[Any], Any] | None = None  # YAML's structured form (a mapping, a list) -> the option's value


def option(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] = (),
    engine: bool = False,
    metavar: str | None = None,
    shown_default: str | None = None,
    bare: str | None = None,
    none_words: tuple[str, ...] = (),
    from_yaml: Callable[[Any], Any] | None = None,
) -> Any:
    """A ServerConfig field that is an option: ``port: int = option(8000, "TCP port to listen on")``."""
    meta = Option(help, choices, engine, metavar, shown_default, bare, none_words, from_yaml)
    return dataclasses.field(default=default, metadata={"option": meta})


@dataclass(frozen=True)
class Spec:
    """One option as the sources, the flags and the docs see it."""

    name: str
    kind: type  # str, int, float or bool
    nullable: bool  # None is a value (unset)
    default: Any
    option: Option

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def flag_for(self, value: Any) -> str:
        """The flag as it was written for ``value``: a switch turned off is ``--no-...``."""
        return f"--no-{self.flag[2:]}" if self.kind is bool and value is False else self.flag

    def expected(self) -> str:
        if self.kind is bool:
            return "one of " + ", ".join(TRUE_WORDS + FALSE_WORDS)
        return " or ".join((self.kind.__name__, *self.option.none_words))

    def from_text(self, raw: str) -> Any:
        """A value written as text (a variable, a flag). Raises ValueError("must be ..., got ...")."""
        raw = raw.strip()
        if raw in self.option.none_words:
            return None
        try:
            if self.kind is bool:
                return {**dict.fromkeys(TRUE_WORDS, True), **dict.fromkeys(FALSE_WORDS, False)}[raw.lower()]
            return self.kind(raw)
        except (KeyError, ValueError):
            raise ValueError(f"must be {self.expected()}, got {raw!r}") from None

    def from_yaml(self, value: Any) -> Any:
        if isinstance(value, str) and value in self.option.none_words:
            return None
        return self.option.from_yaml(value) if self.option.from_yaml is not None else value

    def problem(self, value: Any) -> str | None:
        """Why ``value`` cannot be this option's, or None. Messages start with the option's name, which is how
        server.options_sources finds where a refused value came from."""
        if value is None:
            return None if self.nullable else f"{self.name} must not be null"
        accepted = (int, float) if self.kind is float else (self.kind,)
        if not isinstance(value, accepted) or (isinstance(value, bool) and self.kind is not bool):
            return f"{self.name} must be {self.kind.__name__}, got {value!r}"
        if self.option.choices and value not in self.option.choices:
            return f"{self.name} must be one of {', '.join(self.option.choices)}, got {value!r}"
        return None


def specs(cls: type) -> tuple[Spec, ...]:
    """The options of a dataclass declared with ``option(...)``, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kinds = [t for t in typing.get_args(hints[f.name]) if t is not types.NoneType] or [hints[f.name]]
        nullable = type(None) in typing.get_args(hints[f.name])
        out.append(Spec(f.name, kinds[0], nullable, f.default, f.metadata["option"]))
    return tuple(out)
