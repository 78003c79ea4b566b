"""The embedded pair's compile cache (engine.worker.compile_cache): `python -m recipe.compile_cache` (or
`make compile-cache`). Starts the server as `make serve` does, compiling before it answers (`--compile start`),
in an empty inductor cache directory of its own, stops it once /health answers, and packs that directory
beside the target. Rebuild it when the forward's code or torch changes (a stale one only stops helping).
~10 minutes on 2 CPU cores.
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

from engine import pack_compile_cache

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("recipe.compile_cache")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build(target: Path, timeout: float) -> Path:
    with tempfile.TemporaryDirectory(prefix="specd-inductor-") as cache:
        port = free_port()
        env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": cache}
        cmd = [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port", str(port), "--compile",
               "start"]
        logger.info("compiling into %s: %s", cache, " ".join(cmd))
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
        try:
            deadline, t0 = time.monotonic() + timeout, time.monotonic()
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"the server exited with {proc.returncode} before answering /health")
                if time.monotonic() > deadline:
                    raise SystemExit(f"the server did not answer /health within {timeout:.0f} s")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(2)
            logger.info("compiled in %.0f s", time.monotonic() - t0)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        archive = pack_compile_cache(Path(cache), target)
    logger.info("wrote %s (%.1f MiB)", archive, archive.stat().st_size / 2**20)
    return archive


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
