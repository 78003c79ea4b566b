"""The default corpus: the Python standard library's own source, split by a hash of each file's path.

The file list is deterministic for a given CPython build (sorted relative paths, fixed exclusions), and the
split depends only on the path, so the held-out files stay held out when the list grows or shrinks.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Test suites are a large, repetitive share of the stdlib; the generated tables (encodings, the pydoc topic
# dump, sysconfig data) are data rather than code. site-packages is not the stdlib.
EXCLUDED_DIRS = frozenset(
    {"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data", "__pycache__", "turtledemo"}
)
EXCLUDED_PREFIXES = ("config-", "_sysconfigdata")
HELD_OUT_ONE_IN = 20  # ~5% of files


@dataclass(frozen=True)
class CorpusFile:
    relpath: str
    path: Path

    @property
    def held_out(self) -> bool:
        return is_held_out(self.relpath)

    def read(self) -> str:
        return self.path.read_text(encoding="utf-8", errors="replace")


def is_held_out(relpath: str) -> bool:
    return hashlib.sha256(relpath.encode()).digest()[0] % HELD_OUT_ONE_IN == 0


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[CorpusFile]:
    """Every .py file under the stdlib root outside the exclusions, sorted by relative path."""
    root = root or stdlib_root()
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS or part.startswith(EXCLUDED_PREFIXES) for part in rel.parts):
            continue
        files.append(CorpusFile(rel.as_posix(), path))
    return sorted(files, key=lambda f: f.relpath)


def split(files: list[CorpusFile]) -> tuple[list[CorpusFile], list[CorpusFile]]:
    """(train, held_out)."""
    return [f for f in files if not f.held_out], [f for f in files if f.held_out]


def text_files(paths: list[str]) -> list[CorpusFile]:
    """A user corpus for `specd distill --corpus`: files as given, directories walked for text-like files."""
    suffixes = {".py", ".txt", ".md", ".rst", ".json", ".jsonl", ".c", ".h", ".js", ".ts", ".go", ".rs", ".java"}
    out: list[CorpusFile] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += [CorpusFile(str(f), f) for f in sorted(p.rglob("*")) if f.is_file() and f.suffix in suffixes]
        elif p.is_file():
            out.append(CorpusFile(str(p), p))
        else:
            raise FileNotFoundError(f"corpus path {p} does not exist")
    if not out:
        raise ValueError(f"no text files found under {', '.join(paths)}")
    return out


def manifest(files: list[CorpusFile]) -> list[dict[str, object]]:
    """What a rerun must see to reproduce the pair: each file's path, size, content hash and split."""
    return [
        {
            "path": f.relpath,
            "bytes": f.path.stat().st_size,
            "sha256": hashlib.sha256(f.path.read_bytes()).hexdigest()[:16],
            "held_out": f.held_out,
        }
        for f in files
    ]
