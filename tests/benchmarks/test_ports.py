"""free_port (benchmarks/peer_bench/ports.py): a port handed to one process's server is not handed to another's
while the first server may still be starting."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from benchmarks.peer_bench import ports


class Draws:
    """The picks, in order: what two processes' generators drawing the same numbers would give."""

    def __init__(self, *values: int) -> None:
        self.values = list(values)

    def randrange(self, low: int, high: int) -> int:
        value = self.values.pop(0)
        assert low <= value < high
        return value


@pytest.fixture
def claims(tmp_path, monkeypatch) -> Path:
    monkeypatch.setattr(ports, "CLAIMS", tmp_path / "claims")
    return tmp_path / "claims"


def test_a_port_picked_and_not_yet_bound_is_not_picked_again(claims, monkeypatch):
    monkeypatch.setattr(ports, "_pick", Draws(23917, 23917, 23918))
    first = ports.free_port()  # its server has not bound it yet
    assert first == 23917
    assert ports.free_port() == 23918, "the same draw handed out the same port twice"


def test_a_claim_older_than_any_server_start_is_taken_over(claims, monkeypatch):
    monkeypatch.setattr(ports, "_pick", Draws(23917, 23917))
    assert ports.free_port() == 23917
    stale = time.time() - ports.CLAIM_SECONDS - 1
    os.utime(claims / "23917", (stale, stale))
    assert ports.free_port() == 23917


def test_a_listening_port_is_never_picked(claims, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        monkeypatch.setattr(ports, "LOWEST", 1024)
        monkeypatch.setattr(ports, "_ephemeral_start", lambda: 65536)
        monkeypatch.setattr(ports, "_pick", Draws(taken, 23919))
        assert ports.free_port() == 23919
