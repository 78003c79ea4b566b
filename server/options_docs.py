"""The options table of docs/configuration.md, rendered from ServerConfig's declaration, so the docs cannot drift
from the flags (tests/server/test_options.py compares them).

    python -m server.options_docs            print the table
    python -m server.options_docs --write    rewrite it between the markers in docs/configuration.md"""

from __future__ import annotations

import argparse

from server.config import REPO_ROOT, ServerConfig
from server.options import Spec, specs
from server.options_cli import shown_default
from server.options_sources import CONFIG_ENV, CONFIG_HELP, DEVICE_MEMORY_HELP, DRY_RUN_HELP

BEGIN, END = "<!-- options:begin -->", "<!-- options:end -->"
DOC = REPO_ROOT / "docs" / "configuration.md"


def render() -> str:
    """The markdown table: one row for --config, one per option in declaration order, then the start-up flags."""
    rows = ["| flag | variable | default | what |", "|---|---|---|---|"]
    rows.append(f"| `--config FILE` | `{CONFIG_ENV}` | none | {CONFIG_HELP} |")
    rows += [_row(spec) for spec in specs(ServerConfig)]
    rows.append(f"| `--dry-run` | none | off | {DRY_RUN_HELP} |")
    rows.append(f"| `--device-memory SIZE` | none | the device's | {DEVICE_MEMORY_HELP} |")
    return "\n".join(rows) + "\n"


def _row(spec: Spec) -> str:
    return f"| {_flags(spec)} | `{spec.env}` | {shown_default(spec)} | {spec.option.help} |"


def _flags(spec: Spec) -> str:
    if spec.kind is bool:  # the flag that changes the default first
        on, off = f"`{spec.flag}`", f"`--no-{spec.flag[2:]}`"
        return f"{off}, {on}" if spec.default is True else f"{on}, {off}"
    metavar = spec.option.metavar
    if metavar and spec.option.bare is not None:
        return f"`{spec.flag} [{metavar}]`"
    return f"`{spec.flag} {metavar}`" if metavar else f"`{spec.flag}`"


def documented(text: str) -> str:
    """The table as the page has it (between the markers)."""
    return text[text.index(BEGIN) + len(BEGIN): text.index(END)].strip("\n") + "\n"


def rewrite(text: str) -> str:
    return text[: text.index(BEGIN) + len(BEGIN)] + "\n" + render() + text[text.index(END):]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server.options_docs", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite the table in {DOC.relative_to(REPO_ROOT)}")
    args = parser.parse_args(argv)
    if args.write:
        DOC.write_text(rewrite(DOC.read_text()))
    else:
        print(render(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
