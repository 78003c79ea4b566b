"""Randomness keyed by (request key, token position, purpose), so that a draw does not depend on what
shares the batch or on how the request's steps were cut (token budget, free KV slots, preemption).

Each draw is a pure function of its key, computed on the device with integer hashing (a counter-based
generator): no generator state to carry, advance or forget, and one vectorised call per step for all
rows, whatever their requests. The hash is splitmix64's finaliser, whose output passes BigCrush when
fed a counter; torch's int64 arithmetic wraps on overflow, which is what the 64-bit mixing wants.
"""

from __future__ import annotations

import enum
import random

import torch


class Purpose(enum.IntEnum):
    SAMPLE = 0  # the target's own draw for the token at this position (and a seeded request's drafts)
    DRAFT = 1  # an unseeded request's draft at this position
    ACCEPT = 2  # the accept test of the draft at this position


_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_MASK = (1 << 64) - 1


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 torch stores."""
    x &= _MASK
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on signed integers)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: a bijection of 64-bit words that scatters every input bit."""
    x = (x ^ _shr(x, 30)) * _signed(_M1)
    x = (x ^ _shr(x, 27)) * _signed(_M2)
    return x ^ _shr(x, 31)


def draft_purpose(seeded: bool) -> Purpose:
    """A seeded request drafts with the target's own noise at each position (engine.sample.verify
    explains why); the others draw their drafts independently."""
    return Purpose.SAMPLE if seeded else Purpose.DRAFT


def request_key(seed: int | None, engine_random: random.Random) -> int:
    """A seeded request's key is its seed; the others get one from the engine's own seeded stream."""
    return _signed(seed if seed is not None else engine_random.getrandbits(64))


Purposes = Purpose | torch.Tensor  # one for every row, or [R] int64 of Purpose values


def _streams(keys: torch.Tensor, positions: torch.Tensor, purpose: Purposes) -> torch.Tensor:
    """One 64-bit stream id per row. keys [R] int64, positions [R] int64 -> [R] int64."""
    counter = positions * 4 + purpose  # [R] distinct per (position, purpose)
    return _mix(_mix(keys + _signed(_GOLDEN)) + counter * _signed(_GOLDEN))


def _unit(bits: torch.Tensor) -> torch.Tensor:
    """Top 53 bits -> a float64 strictly inside (0, 1)."""
    return (_shr(bits, 11).double() + 0.5) * 2.0**-53


def uniforms(keys: torch.Tensor, positions: torch.Tensor, purpose: Purposes) -> torch.Tensor:
    """U(0, 1) per row. keys, positions [R] int64 -> [R] float32."""
    return _unit(_mix(_streams(keys, positions, purpose))).float()


def exponentials(keys: torch.Tensor, positions: torch.Tensor, purpose: Purposes, vocab: int) -> torch.Tensor:
    """Exp(1) noise per row and token. keys, positions [R] int64 -> [R, V] float32."""
    streams = _streams(keys, positions, purpose)  # [R]
    tokens = torch.arange(vocab, device=keys.device, dtype=torch.long)  # [V]
    bits = _mix(streams[:, None] + (tokens[None, :] + 1) * _signed(_GOLDEN))  # [R, V]
    return (-torch.log(_unit(bits))).float()
