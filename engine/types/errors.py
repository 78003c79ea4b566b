"""Errors a request's parameters raise: each names the field, which the server maps to a 400."""

from __future__ import annotations


class SamplingParamError(ValueError):
    """A sampling parameter is out of range; ``param`` names the field (the server maps it to a 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
