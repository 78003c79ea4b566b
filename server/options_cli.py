"""The command-line flags of the options declared on a dataclass: ``--name-with-dashes`` for each, a switch as a
pair (``--prefix-caching`` / ``--no-prefix-caching``). A flag not given is absent from the parsed arguments, so it
overrides neither the YAML file nor the environment."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from server.options import Spec, specs


def add_option_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    for spec in specs(cls):
        add_flag(parser, spec)


def add_flag(parser: argparse.ArgumentParser, spec: Spec) -> None:
    o = spec.option
    text = f"{o.help} (default: {shown_default(spec)})".replace("`", "").replace("%", "%%")
    if spec.kind is bool:
        parser.add_argument(spec.flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=text)
        return
    parser.add_argument(
        spec.flag,
        type=_converter(spec),
        choices=o.choices or None,
        nargs="?" if o.bare is not None else None,
        const=o.bare,
        metavar=o.metavar,
        default=argparse.SUPPRESS,
        help=text,
    )


def _converter(spec: Spec) -> Callable[[str], Any]:
    def convert(raw: str) -> Any:
        try:
            return spec.from_text(raw)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = spec.kind.__name__  # argparse names the type in some of its messages
    return convert


def shown_default(spec: Spec) -> str:
    """The default as --help and the docs state it (markdown: values in backticks)."""
    if spec.option.shown_default is not None:
        return spec.option.shown_default
    value = spec.default
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, str):
        return f"`{value}`"
    return f"{value:g}" if isinstance(value, float) else str(value)
