"""Per-request randomness, so a seeded request draws the same numbers whatever shares its batch."""

from __future__ import annotations

import torch


class RequestRandom:
    """A seeded request owns a generator; the rest share the engine's. Every draw for a request
    comes from its own stream in an order fixed by that request's own steps."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self._shared = torch.Generator(device=device).manual_seed(seed)
        self._own: dict[str, torch.Generator] = {}

    def add(self, request_id: str, seed: int | None) -> None:
        if seed is not None:
            self._own[request_id] = torch.Generator(device=self.device).manual_seed(seed)

    def remove(self, request_id: str) -> None:
        self._own.pop(request_id, None)

    def generator(self, request_id: str) -> torch.Generator:
        return self._own.get(request_id, self._shared)

    def uniforms(self, request_id: str, n: int) -> torch.Tensor:
        return torch.rand(n, generator=self.generator(request_id), device=self.device)  # [n]

    def exponentials(self, request_id: str, n: int, vocab: int) -> torch.Tensor:
        out = torch.empty(n, vocab, device=self.device)  # [n, V]
        return out.exponential_(generator=self.generator(request_id))
