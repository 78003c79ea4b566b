"""The embedded pair's compile cache for this kind of CPU (engine.worker.compile_cache): `python -m
recipe.compile_cache` (or `make compile-cache`). Starts the server as `make serve` does (`--compile background`:
the compile runs in a child process, engine.worker.precompile) in an empty inductor cache directory of its own,
with this machine's shipped archive moved aside so that it does not seed itself, waits until /health says
compiled, stops it, compiles the prompt layouts there too (``compile_prompt_graphs``) and packs that directory
beside the target; the archives other kinds of CPU built stay. Rebuild it when the forward's code or torch changes
(a stale one only stops helping). ~11 minutes on 2 idle AVX-512 cores, ~16 on AVX2 ones, ~9 on AMX ones, and
6.5 more for the prompt graphs (AVX-512).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from engine import compile_cache_archive, compile_prompt_files, pack_compile_cache

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("recipe.compile_cache")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build(target: Path, timeout: float) -> Path:
    archive = compile_cache_archive(target)  # this machine's: another kind of CPU's stays as it is
    aside = archive.with_suffix(".old")
    if archive.exists():
        archive.replace(aside)
    try:
        with tempfile.TemporaryDirectory(prefix="specd-inductor-") as cache:
            port = free_port()
            env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": cache, "SPECD_LOG_LEVEL": "info"}
            cmd = [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port", str(port), "--compile",
                   "background"]
            logger.info("compiling into %s: %s", cache, " ".join(cmd))
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
            client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
            try:
                deadline, t0, state = time.monotonic() + timeout, time.monotonic(), "?"
                while state != "compiled":
                    if proc.poll() is not None:
                        raise SystemExit(f"the server exited with {proc.returncode} before it compiled")
                    if time.monotonic() > deadline:
                        raise SystemExit(f"the server did not compile within {timeout:.0f} s")
                    time.sleep(5)
                    try:
                        state = client.get("/health").json().get("compile", "?")
                    except (httpx.HTTPError, ValueError):
                        continue
                    if state == "failed":
                        raise SystemExit("the compile failed: see the server's log above")
                logger.info("compiled in %.0f s", time.monotonic() - t0)
            finally:
                client.close()
                proc.terminate()
                proc.wait(timeout=60)
            compile_prompt_graphs(cache)
            packed = pack_compile_cache(Path(cache), target)
    except BaseException:
        if aside.exists():
            aside.replace(archive)
        raise
    aside.unlink(missing_ok=True)
    logger.info("wrote %s (%.1f MiB)", packed, packed.stat().st_size / 2**20)
    return packed


def compile_prompt_graphs(cache: str | None, **options: object) -> None:
    """Into ``cache`` (None: inductor's own): the prompt graphs (engine.worker.prompt_layouts) of the server
    ``options`` configure (ServerConfig's fields; none: the default pair), which it loads where it finds them but
    does not compile itself."""
    from server.config import ServerConfig

    if cache is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    server = ServerConfig(**options)
    config = server.engine_config()
    paths = [p for p in (server.target_path, server.draft_path) if p is not None]
    t0 = time.monotonic()
    logger.info("compiling the prompt layouts of %s", " and ".join(paths))
    files = compile_prompt_files(paths, config.dtype, config.k_max, config.block_size, config.trust_remote_code)
    logger.info("compiled %s in %.0f s", ", ".join(f.name for f in files), time.monotonic() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=ROOT / "models" / "default" / "target",
                    help="where the archive goes: the target the server serves by default")
    ap.add_argument("--timeout", type=float, default=3600.0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    build(args.target, args.timeout)


if __name__ == "__main__":
    main()
