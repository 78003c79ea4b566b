"""A free loopback port for a server a test or benchmark starts."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Below Linux's ephemeral range: a port the kernel hands out for outgoing connections and for binds to port 0 (a
# gloo rank's sockets, a client's) can be taken between the moment a free one is picked here and the moment the
# server binds it. Picked from the ephemeral range, a tensor-parallel rank's socket once took the HTTP port first.
LOWEST = 20000


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port on 127.0.0.1 nothing listens on, outside the ephemeral range where it can."""
    top = _ephemeral_start()
    for _ in range(100) if top - LOWEST > 1000 else ():
        port = random.randrange(LOWEST, top)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
