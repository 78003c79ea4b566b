"""``torch.compile`` with a recompile limit of its own, on every torch the project supports.

torch 2.12 and later take ``recompile_limit`` per compiled function. Older ones (2.11 is what GPU images carry)
have only dynamo's config, whose settings hold for the thread that made them: there the limit is set around
each call, so a background warm-up thread compiles under it too.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

TAKES_LIMIT = "recompile_limit" in inspect.signature(torch.compile).parameters


def compile_with_limit(fn: Callable[..., Any], limit: int, **kwargs: Any) -> Callable[..., Any]:
    if TAKES_LIMIT:
        return torch.compile(fn, recompile_limit=limit, **kwargs)
    compiled = torch.compile(fn, **kwargs)
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"

    @functools.wraps(fn)
    def call(*args: Any, **kw: Any) -> Any:
        if torch.compiler.is_compiling():  # traced into an enclosing compile, under that one's limit
            return compiled(*args, **kw)
        with config.patch(**{name: max(limit, getattr(config, name))}):
            return compiled(*args, **kw)

    return call
