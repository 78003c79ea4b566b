"""Builds a source into a shared library once per (source, flags, compiler, CPU), cached under
``$SPECD_CACHE/kernels`` (default ``~/.cache/specd/kernels``; the system temp directory where that is not
writable). A C file is loaded with ctypes (``library``): it builds in a second with no headers of torch's, and a
call lets go of the GIL as torch's own kernels do. A C++ file that registers torch operators is loaded into torch
(``operators``): a compiled graph calls those through torch's dispatcher in C++, where a Python operator costs
~20 us a call in Python."""

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
    lib = _built(source, compile_flags, link_flags + ["-lm"], what,
                 os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc"))
    return None if lib is None else ctypes.CDLL(str(lib))


def operators(source: Path, compile_flags: list[str], what: str) -> bool:
    """The C++ ``source``, which registers operators with TORCH_LIBRARY, built against this torch and loaded into
    it; False, with the reason logged, where it cannot be."""
    import torch
    from torch.utils import cpp_extension

    torch_lib = str(Path(torch.__file__).parent / "lib")
    flags = [*compile_flags, "-fPIC", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             *(f"-I{p}" for p in cpp_extension.include_paths()), f"-DSPECD_TORCH={torch.__version__}"]
    lib = _built(source, flags, ["-shared", f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lc10", "-ltorch_cpu"],
                 what, os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++"))
    if lib is None:
        return False
    try:
        torch.ops.load_library(str(lib))
    except OSError:
        logger.warning("loading %s failed; keeping its fallback", what, exc_info=True)
        return False
    return True


def _built(source: Path, compile_flags: list[str], link_flags: list[str], what: str, compiler: str | None
           ) -> Path | None:
    if compiler is None:
        logger.info("no compiler for %s: it keeps its slower fallback", what)
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
                result = subprocess.run([compiler, obj, "-o", tmp, *link_flags], capture_output=True, text=True)
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
    return lib
