"""Compile caches shipped beside a model: inductor's cache directory as it stood after the server compiled that
model, packed (``compile-cache-<isa>.tar.xz``), with the machine it was built on (``compile-cache-<isa>.json``),
one pair per kind of CPU it was built on. A machine that matches one (torch, Python, the CPU's vector
instructions, the C++ compiler) unpacks it into its own cache before compiling. It holds the child's graph files
(engine.worker.precompile), which the server loads at once where the code they traced is this checkout's, and
inductor's own entries, which make a compile after a change outside the layers (BUILT_FROM) faster. Anything else
that differs only makes both miss and compile as they would have: an archive can go stale, never wrong.

    python -m recipe.compile_cache     # builds the embedded pair's for this machine (make compile-cache)
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import torch

from engine.worker.compile_lock import SUFFIX

logger = logging.getLogger(__name__)

PREFIX = "compile-cache"  # compile-cache-<isa>.tar.xz and .json; a model packed before: compile-cache.tar.xz
PRECOMPILED = "specd-precompiled"  # engine.worker.precompile's graph files, under the cache (packed with it)


ENGINE_ROOT = Path(__file__).resolve().parents[1]
# What a graph is built from besides the code dynamo traced (checked line by line at load, aot_graphs.stale):
# the layers' custom ops and their C kernels, how a graph picks its layout, and which layouts there are.
BUILT_FROM = ("layers", "native", "worker/aot_graphs.py", "worker/warm_up_layouts.py")


@functools.cache
def engine_source() -> str:
    """A digest of the files in BUILT_FROM."""
    source = hashlib.sha256()
    for part in BUILT_FROM:
        root = ENGINE_ROOT / part
        for path in sorted([root] if root.is_file() else root.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                source.update(path.relative_to(ENGINE_ROOT).as_posix().encode() + path.read_bytes())
    return source.hexdigest()


def tag_caches() -> None:
    """Keys inductor's caches by engine_source too. A cached graph brings back the shape guards it was compiled
    under: one cached when small_linear.SMALL_ROWS was 16 held every graph compiled over it to 16 rows, and a
    32-sequence decode then ran eagerly, though the code now compiles it (with a cache once used by an older
    checkout, the "none --compile" baseline served 2,504 of 2,550 forwards at 32 and 64 concurrent eagerly)."""
    torch.compiler.config.cache_key_tag = f"specd-{engine_source()[:16]}"


def machine() -> dict[str, str]:
    """What a compiled graph depends on besides its code: a cache built where any of these differ is not used."""
    from torch._inductor import cpu_vec_isa

    cxx = os.environ.get("CXX", "g++")
    compiler = ""
    if shutil.which(cxx):
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
        compiler = out.splitlines()[0] if out else ""
    return {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "isa": str(cpu_vec_isa.pick_vec_isa()), "cxx": compiler}


def cache_dir() -> Path:
    """Inductor's cache directory in this process (TORCHINDUCTOR_CACHE_DIR, else its default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    return Path(inductor_cache_dir())


def archive(model_dir: str | os.PathLike[str], built: dict[str, str] | None = None) -> Path:
    """Where the cache built on ``built`` (this machine by default) lies in ``model_dir``: one per kind of CPU."""
    isa = (built or machine())["isa"]
    return Path(model_dir) / f"{PREFIX}-{re.sub(r'[^a-z0-9]+', '-', isa.lower()).strip('-') or 'scalar'}.tar.xz"


def manifest(packed: Path) -> Path:
    """The machine the archive ``packed`` was built on, beside it."""
    return packed.with_name(packed.name.removesuffix(".tar.xz") + ".json")


def shipped(model_dir: str | os.PathLike[str]) -> list[tuple[Path, dict[str, str]]]:
    """Each compile cache shipped in ``model_dir`` (an archive with its manifest), with the machine it was built on."""
    archives = sorted(Path(model_dir).glob(f"{PREFIX}*.tar.xz"))
    return [(packed, json.loads(manifest(packed).read_text())) for packed in archives if manifest(packed).is_file()]


def seed(model_dir: str | os.PathLike[str]) -> bool:
    """Unpacks the compile cache shipped in ``model_dir`` that was built on a machine like this one into this
    process's inductor cache, once per archive. Returns whether it unpacked anything."""
    here, caches = machine(), shipped(model_dir)
    differ = {packed.name: [f"{k} {built.get(k)!r} (here {v!r})" for k, v in here.items() if built.get(k) != v]
              for packed, built in caches}
    packed = next((packed for packed, _ in caches if not differ[packed.name]), None)
    if packed is None:
        if caches:
            logger.info("the compile caches shipped in %s were built elsewhere: %s; compiling from scratch", model_dir,
                        "; ".join(f"{name}: {', '.join(d)}" for name, d in differ.items()))
        return False
    target = cache_dir()
    marker = target / f".specd-seeded-{hashlib.sha256(packed.read_bytes()).hexdigest()[:16]}"
    if marker.exists():
        return False
    # Unpacked beside the cache, then each file renamed into it: another process compiling meanwhile reads a
    # file whole or not at all.
    with tempfile.TemporaryDirectory(dir=target, prefix=".specd-unpack-") as staging:
        try:
            with tarfile.open(packed) as tar:
                tar.extractall(staging, filter="data")  # no links out of it, no absolute paths
        # A damaged archive costs a compile, not the server; one cut short (read while written) raises lzma's EOFError.
        except (tarfile.TarError, OSError, EOFError) as exc:
            logger.warning("the compile cache shipped in %s could not be unpacked (%s); compiling from scratch",
                           model_dir, exc)
            return False
        for path in sorted(Path(staging).rglob("*")):
            if path.is_file():
                dest = target / path.relative_to(staging)
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, dest)
    marker.touch()
    logger.info("unpacked the compile cache shipped in %s (%s) into %s", model_dir, packed.name, target)
    return True


def pack(cache: Path, model_dir: Path) -> Path:
    """Writes ``cache`` (a directory a compile filled) and this machine's manifest into ``model_dir``, beside the
    caches other kinds of machine built."""
    packed = archive(model_dir)
    partial = packed.with_name(packed.name + ".partial")  # whole or not at all, for a server unpacking it meanwhile
    with tarfile.open(partial, "w:xz") as tar:
        for entry in sorted(cache.iterdir()):  # less the compile locks (engine.worker.compile_lock)
            tar.add(entry, arcname=entry.name, filter=lambda info: None if info.name.endswith(SUFFIX) else info)
    os.replace(partial, packed)
    manifest(packed).write_text(json.dumps(machine(), indent=1) + "\n")
    return packed
