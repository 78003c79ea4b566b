"""A free loopback port for a server a test or benchmark starts."""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from pathlib import Path

# Below Linux's ephemeral range: a port the kernel hands out for outgoing connections and for binds to port 0 (a
# gloo rank's sockets, a client's) can be taken between the moment a free one is picked here and the moment the
# server binds it. Picked from the ephemeral range, a tensor-parallel rank's socket once took the HTTP port first.
LOWEST = 20000
# A port picked here is claimed for this long (a file per port): a server takes seconds to bind the port it was
# given, and in that time another process picking here found it free too (a test's router and the other pytest
# worker's benchmark server, both given 23917). Longer than any server's start; a claim older than this is stale.
CLAIM_SECONDS = 600.0
CLAIMS = Path(tempfile.gettempdir()) / "specd-ports"
_pick = random.SystemRandom()  # a process that seeded the global generator would pick what another one picks


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _claim(port: int) -> bool:
    """Whether this process may hand out ``port``: no other one claimed it in the last CLAIM_SECONDS."""
    path = CLAIMS / str(port)
    try:
        CLAIMS.mkdir(exist_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        try:
            if time.time() - path.stat().st_mtime < CLAIM_SECONDS:
                return False
            os.utime(path)  # a stale claim, taken over
            return True
        except OSError:
            return False
    except OSError:  # no writable temporary directory: the bind check alone
        return True


def free_port() -> int:
    """A port on 127.0.0.1 nothing listens on and no other process picked here lately, outside the ephemeral range
    where it can."""
    top = _ephemeral_start()
    for _ in range(100) if top - LOWEST > 1000 else ():
        port = _pick.randrange(LOWEST, top)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if _claim(port):
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
