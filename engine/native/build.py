"""Builds a C source into a shared library once per (source, flags, compiler, CPU), cached under
``$SPECD_CACHE/kernels`` (default ``~/.cache/specd/kernels``; the system temp directory where that is not
writable), and loads it with ctypes. ctypes, not a torch C++ extension: a plain C file builds in a second with
no headers of torch's, and a call lets go of the GIL as torch's own kernels do."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    return Path(os.environ.get("SPECD_CACHE", Path.home() / ".cache" / "specd")) / "kernels"


def cpu_key() -> str:
    """-march=native builds for this CPU: the library's name carries the CPU's model and flags, so a cache shared
    by machines of different CPUs never loads another's build (an illegal instruction)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return "\n".join([platform.machine(), *lines])


def library(source: Path, compile_flags: list[str], link_flags: list[str], what: str) -> ctypes.CDLL | None:
    """``source`` built (or found built) and loaded; None, with the reason logged, where there is no compiler or
    the build fails. ``what`` names the library in the log."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        logger.info("no C compiler: %s keeps its slower fallback", what)
        return None
    text = source.read_bytes()
    flags = " ".join(compile_flags + link_flags).encode()
    key = hashlib.sha256(b"\0".join([text, flags, compiler.encode(), cpu_key().encode()]))
    try:
        directory = cache_dir()
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        directory = Path(tempfile.gettempdir()) / "specd-kernels"
        directory.mkdir(parents=True, exist_ok=True)
    lib = directory / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not lib.exists():
        # Built under a temporary name and renamed: processes starting together (test workers) never load a
        # half-written library.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
        obj = tmp[: -len(".so")] + ".o"
        t0 = time.perf_counter()
        try:
            result = subprocess.run([compiler, *compile_flags, "-c", str(source), "-o", obj], capture_output=True,
                                    text=True)
            if result.returncode == 0:
                result = subprocess.run([compiler, *link_flags, obj, "-o", tmp, "-lm"], capture_output=True,
                                        text=True)
            failure = result.stderr[-2000:] if result.returncode != 0 else None
        except OSError as e:  # CC names a compiler that is not there
            failure = str(e)
        Path(obj).unlink(missing_ok=True)
        if failure is not None:
            os.unlink(tmp)
            logger.warning("building %s failed (%s); keeping its fallback:\n%s", what, compiler, failure)
            return None
        os.replace(tmp, lib)
        logger.info("built %s in %.1fs: %s", what, time.perf_counter() - t0, lib)
    return ctypes.CDLL(str(lib))
