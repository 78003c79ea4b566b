"""The README and docs/ cannot go stale: their code runs and their links resolve.

Every fenced ```bash / ```sh / ```shell and ```python block runs here, against the embedded pair served
on the CPU by one `python -m server serve --compile off` for the module, on a free loopback port that
replaces the documented 8000. A block that cannot run here names why in its info string (```bash gpu,
```python not-installed; TAGS below) and is checked as far as it can be: `specd serve` / `specd distill`
command lines are parsed by the real CLI parser, `make` targets must exist, scripts must exist and define
the flags used, repository paths named must exist, Python must compile. Lines that start a server or take
minutes (`make serve`, `make test`, `specd ...`, `python -m server ...`) are checked the same way in every
block and never run: the module's server stands in for the ones that serve. Every relative link and
#anchor (GitHub's heading slugs) must resolve, and the pages keep to their size budget.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.peer_bench.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = {"bash": "shell", "sh": "shell", "shell": "shell", "python": "python"}
# Why a block cannot run here. Anything else after the language is an error: a typo must not skip a block.
TAGS = {
    "gpu": "needs a CUDA GPU",
    "docker": "needs a Docker engine",
    "kubernetes": "needs a cluster",
    "real-model": "needs a model that is not in the repository",
    "long": "runs for minutes (a benchmark or training)",
    "not-installed": "needs a package specd does not depend on",
    "excerpt": "a piece of the source, not a program",
}
DOC_PORT = "8000"
BLOCK_TIMEOUT = 90  # seconds per runnable block
SERVER_START_TIMEOUT = 180
README_MAX_LINES, DOCS_MAX_LINES, DOCS_MAX_PNGS, MAX_COLUMNS = 150, 2000, 8, 100
# Repository folders: a word in a command that starts with one of these names a file that must exist.
REPO_DIRS = ("benchmarks/", "configs/", "deploy/", "docker/", "docs/", "models/", "tests/")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    tags: tuple[str, ...]
    code: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def fenced_blocks(page: Path) -> list[Block]:
    blocks, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(`{3,}|~{3,})\s*(.*)$", lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group(1), m.group(2).strip()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence)
                    and not lines[j].strip().strip(fence[0])), len(lines))
        words = [w for w in re.split(r"[\s,]+", info) if w]
        lang = words[0].lower() if words else ""
        blocks.append(Block(page, i + 1, lang, tuple(words[1:]), "\n".join(lines[i + 1:end]) + "\n"))
        i = end + 1
    return blocks


def without_code(text: str) -> str:
    """The page's prose: fenced blocks and inline code spans blanked out (links there are not links)."""
    text = re.sub(r"(?ms)^(`{3,}|~{3,}).*?^\1[ \t]*$", "", text)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text)


# ---- links and anchors ---------------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text, lower-cased, punctuation dropped, spaces to dashes."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for line in without_code(page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        found.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", line))
    return found


def links(page: Path) -> list[str]:
    prose = without_code(page.read_text())
    inline = re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose)
    defined = re.findall(r"(?m)^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", prose)
    return inline + defined


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading or anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_pages_keep_to_their_budget():
    readme = PAGES[0].read_text().splitlines()
    assert len(readme) <= README_MAX_LINES, f"README.md has {len(readme)} lines"
    docs = sum(len(p.read_text().splitlines()) for p in PAGES[1:])
    assert docs <= DOCS_MAX_LINES, f"docs/*.md have {docs} lines together"
    pngs = sorted((ROOT / "docs").glob("*.png"))
    assert len(pngs) <= DOCS_MAX_PNGS, f"{len(pngs)} PNGs in docs/"
    linked = {(p.parent / t.partition("#")[0]).resolve() for p in PAGES for t in links(p)}
    assert not [p.name for p in pngs if p.resolve() not in linked], "a PNG in docs/ that no page links"
    # Tables and verbatim output (```text: log lines as the server writes them) cannot wrap; the rest can.
    verbatim = {(b.page, b.line + i) for b in BLOCKS if b.lang == "text" for i in range(1, b.code.count("\n") + 1)}
    wide = [f"{p.relative_to(ROOT)}:{i}" for p in PAGES for i, line in enumerate(p.read_text().splitlines(), 1)
            if len(line) > MAX_COLUMNS and not line.lstrip().startswith("|") and (p, i) not in verbatim]
    assert not wide, f"lines over {MAX_COLUMNS} columns: {wide}"


def test_docs_are_reference_not_history():
    for page in PAGES:
        hits = re.findall(r"(?i)\bissues? #?\d+\b", page.read_text())
        assert not hits, f"{page.relative_to(ROOT)} refers to {hits}: say what is true, not where it came from"


def test_every_metric_the_server_exports_is_documented():
    source = "\n".join(p.read_text() for p in (ROOT / "server").rglob("*.py"))
    exported = set(re.findall(r"\"(specd:[a-z_]+)\"", source))
    assert exported, "no specd:* series found under server/"
    documented = (ROOT / "docs" / "observability.md").read_text()
    missing = sorted(m for m in exported if m not in documented)
    assert not missing, f"docs/observability.md does not describe {missing}"


def test_every_route_the_server_serves_is_documented():
    source = "\n".join(p.read_text() for p in (ROOT / "server").rglob("*.py"))
    routes = {re.sub(r"\{(\w+):\w+\}", r"{\1}", path)
              for path in re.findall(r"@\w+\.(?:get|post|put|patch|delete)\(\s*\"([^\"]+)\"", source)}
    assert routes, "no routes found under server/"
    documented = (ROOT / "docs" / "api.md").read_text()
    missing = sorted(r for r in routes if f"{r}`" not in documented)
    assert not missing, f"docs/api.md's routes table does not list {missing}"


# ---- code blocks -----------------------------------------------------------------------------------------------

BLOCKS = [b for page in PAGES for b in fenced_blocks(page)]
CODE_BLOCKS = [b for b in BLOCKS if b.lang in RUNNABLE]


def test_code_blocks_carry_only_known_tags():
    unknown = {f"{b.name}: {t}" for b in BLOCKS if b.lang in RUNNABLE for t in b.tags if t not in TAGS}
    assert not unknown, f"unknown tags (known: {sorted(TAGS)}): {sorted(unknown)}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "json"], ids=lambda b: b.name)
def test_json_blocks_parse(block):
    json.loads(block.code)


def _env() -> dict[str, str]:
    """The suite's environment without the developer's SPECD_* settings; the venv's python and specd first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECD_")}
    env.update(SPECD_COMPILE="off", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="module")
def doc_server(tmp_path_factory) -> Iterator[int]:
    """`make serve`, as the docs describe it, on a free port: the embedded pair, eager."""
    port = free_port()
    log = tmp_path_factory.mktemp("doc-server") / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "server", "serve", "--port", str(port), "--compile", "off",
             "--log-level", "warning"],
            cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            if time.monotonic() > deadline:
                pytest.fail(f"the server was not ready within {SERVER_START_TIMEOUT} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _at_port(code: str, port: int) -> str:
    return re.sub(rf"\b(?:localhost|127\.0\.0\.1):{DOC_PORT}\b", f"127.0.0.1:{port}", code)


@pytest.mark.timeout(BLOCK_TIMEOUT * 2 + SERVER_START_TIMEOUT)
@pytest.mark.parametrize("block", CODE_BLOCKS, ids=lambda b: b.name + (f"[{','.join(b.tags)}]" if b.tags else ""))
def test_code_block(block, request):
    kind = RUNNABLE[block.lang]
    if kind == "python":
        compile(block.code, block.name, "exec")  # raises on a syntax error, run or not
        if not block.tags:
            port = request.getfixturevalue("doc_server")
            _run([sys.executable, "-c", _at_port(block.code, port)], block)
        return
    to_run, cwd = [], ROOT
    for line in logical_lines(block.code):
        commands = simple_commands(line, cwd)
        if block.tags or any(_never_run(words) for words, _ in commands):
            for words, where in commands:
                check_command(words, where, block)
            cwd = commands[-1][1] if commands else cwd
            if commands and _command(commands[-1][0])[:1] == ["cd"]:
                cwd = (cwd / _command(commands[-1][0])[1]).resolve()
        else:
            to_run.append(line)
    if to_run:
        port = request.getfixturevalue("doc_server")
        _run(["bash", "-euo", "pipefail", "-c", _at_port("\n".join(to_run), port)], block)


def _run(argv: list[str], block: Block) -> None:
    try:
        done = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.name} ran past {BLOCK_TIMEOUT} s")
    assert done.returncode == 0, f"{block.name} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


# ---- what a block that cannot run is checked for ------------------------------------------------------------


def logical_lines(code: str) -> list[str]:
    """Lines with backslash continuations joined; blank and comment-only lines dropped."""
    out, current = [], ""
    for raw in code.splitlines():
        if raw.rstrip().endswith("\\"):
            current += raw.rstrip()[:-1] + " "
            continue
        line = (current + raw).strip()
        current = ""
        if line and not line.startswith("#"):
            out.append(line)
    return out


def simple_commands(line: str, cwd: Path = ROOT) -> list[tuple[list[str], Path]]:
    """``a && cd x && b | c`` -> each command's words and the directory it runs in."""
    commands, words = [], []
    for word in [*shlex.split(line, comments=True), "&&"]:
        if word in ("&&", "||", ";", "|", "&"):
            if words:
                commands.append((words, cwd))
                if words[0] == "cd" and len(words) > 1:
                    cwd = (cwd / words[1]).resolve()
            words = []
        else:
            words.append(word)
    return commands


def _command(words: list[str]) -> list[str]:
    """Without leading VAR=value assignments."""
    i = 0
    while i < len(words) and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[i]):
        i += 1
    return words[i:]


def _never_run(words: list[str]) -> bool:
    """`make` (serve, test, ...), `specd` and `python -m server` lines: checked, never run here."""
    w = _command(words)
    return w[:1] in (["make"], ["specd"]) or w[1:3] == ["-m", "server"]


def check_command(words: list[str], cwd: Path, block: Block) -> None:
    where = f"{block.name}: {shlex.join(words)}"
    words = _command(words)
    if not words:
        return
    for word in words:  # repository paths a command names, wherever it runs
        value = word.split("=", 1)[-1]
        if value.startswith("/configs/"):  # the compose file and the manifests mount configs/ there
            value = value[1:]
        if value.startswith(REPO_DIRS) and not any(c in value for c in "*$"):
            assert (cwd / value).exists() or (ROOT / value).exists(), f"{where}: {value} does not exist"
    prog, args = words[0], words[1:]
    if prog == "cd":
        assert (cwd / args[0]).is_dir(), f"{where}: no directory {args[0]}"
    elif prog == "make":
        targets = set(re.findall(r"(?m)^([A-Za-z0-9_.-]+):", (ROOT / "Makefile").read_text()))
        for t in args:
            if not t.startswith("-") and "=" not in t:
                assert t in targets, f"{where}: the Makefile has no target {t!r}"
    elif prog == "specd":
        check_specd(args, cwd, where)
    elif prog in ("python", "python3"):
        if args[:2] in (["-m", "server"],):
            check_specd(args[2:], cwd, where)
        elif args[:1] == ["-m"]:
            check_script(ROOT / (args[1].replace(".", "/") + ".py"), args[2:], where)
        elif args:
            check_script(cwd / args[0], args[1:], where)
    elif prog.endswith((".py", ".sh")):
        check_script(cwd / prog, args, where)
    elif prog == "docker":
        check_docker(args, cwd, where)
    elif prog == "kubectl" and args[:1] == ["apply"]:
        for flag, value in zip(args, args[1:]):
            if flag in ("-k", "-f"):
                assert (cwd / value).exists(), f"{where}: {value} does not exist"
    elif prog == "helm":
        for flag, value in zip(args, args[1:]):
            if flag in ("-f", "--values"):
                assert (cwd / value).exists(), f"{where}: {value} does not exist"


def check_script(path: Path, args: list[str], where: str) -> None:
    assert path.is_file(), f"{where}: no script {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}"
    source = path.read_text()
    if path.suffix == ".sh":  # a wrapper: the flags it passes on belong to the Python script it runs
        source += "".join((ROOT / py).read_text() for py in re.findall(r'(\S+\.py) "\$@"', source))
    for i, arg in enumerate(args):
        flag = arg.split("=", 1)[0]
        if i >= 2 and args[i - 2] == "--variant":  # compare.py's server system started with these options
            check_specd(["serve", *shlex.split(arg)], ROOT, where)
        elif flag.startswith("--"):
            assert f'"{flag}"' in source, f"{where}: {path.name} defines no {flag}"


def check_specd(argv: list[str], cwd: Path, where: str) -> None:
    """Parse a `specd serve|distill` command line with the real parser; a serve line's values are then
    checked by the server's configuration (types, ranges, combinations), without loading anything."""
    from server.cli import build_parser

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            args = vars(build_parser().parse_args(argv))
        except SystemExit:
            pytest.fail(f"{where}: the CLI refuses it: {err.getvalue().strip()}")
    if args.pop("command") != "serve":
        return
    from server.cli import START_FLAGS

    for flag in START_FLAGS:
        args.pop(flag, None)
    config = args.pop("config", None)
    if config is not None:
        config = str(cwd / config if (cwd / config).exists() else ROOT / config.lstrip("/"))
    from server import config as server_config

    load = getattr(server_config, "load_config", None)
    if load is not None:
        try:
            load(config, args, environ={})
        except server_config.ConfigError as exc:
            pytest.fail(f"{where}: {exc}")


DOCKER_VALUE_FLAGS = {"-p", "-v", "-e", "--env", "--env-file", "--name", "--gpus", "-u", "--user", "--mount",
                      "-w", "--workdir", "--network", "--shm-size", "--publish", "--volume", "--entrypoint"}


def check_docker(args: list[str], cwd: Path, where: str) -> None:
    if args[:1] == ["build"]:
        context = next((a for a in reversed(args) if not a.startswith("-")), ".")
        dockerfile = args[args.index("-f") + 1] if "-f" in args else str(Path(context) / "Dockerfile")
        assert (cwd / dockerfile).is_file(), f"{where}: no {dockerfile}"
    elif args[:1] == ["compose"]:
        files = [v for f, v in zip(args, args[1:]) if f in ("-f", "--file")] or ["compose.yaml"]
        for f in files:
            assert (cwd / f).is_file(), f"{where}: no compose file {f}"
    elif args[:1] == ["run"]:
        rest, i = args[1:], 0
        while i < len(rest) and rest[i].startswith("-"):
            i += 2 if rest[i] in DOCKER_VALUE_FLAGS else 1
        flags = rest[i + 1:]  # after the image name: appended to the entrypoint, `specd serve --host ... --port ...`
        check_specd(["serve", "--host", "0.0.0.0", "--port", "8000", *flags], ROOT, where)
