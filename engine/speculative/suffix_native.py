"""The suffix trie in C (kernels/suffix_index.c), behind SuffixIndex's interface: the same counts, the same most
frequent children and so the same drafts, for a few microseconds where the Python trie takes tens (inserting a
token walks ``depth`` nodes: benchmarks/suffix_cost.py). ``new_index`` gives it wherever the C compiler built
it, the Python SuffixIndex elsewhere."""

from __future__ import annotations

import ctypes
from array import array
from pathlib import Path
from typing import Protocol, Union

from engine.native.build import library
from engine.speculative.suffix_index import NONE, Stream, SuffixIndex

SOURCE = Path(__file__).with_name("kernels") / "suffix_index.c"
_LIB: list[ctypes.CDLL | None] = []  # [] before the first build; [None] once it failed


class TokenIndex(Protocol):
    """What suffix decoding asks of an index over token streams."""

    @property
    def num_nodes(self) -> int: ...

    def stream(self) -> AnyStream: ...

    def extend(self, stream: AnyStream, tokens: list[int]) -> None: ...  # a stream of this index's own

    def remove(self, stream: AnyStream) -> None: ...

    def draft(self, context: list[int], limit: int, min_prob: float, factor: float = 1.0, offset: float = 0.0,
              min_match: int = 1) -> tuple[list[int], float]: ...


def _load() -> ctypes.CDLL | None:
    if not _LIB:
        try:
            lib = library(SOURCE, ["-O2", "-fPIC"], ["-shared"], "the C suffix trie (without it: the Python one)")
        except OSError:
            lib = None
        if lib is not None:
            p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
            for name, args, res in (
                ("si_new", [i32], p), ("si_delete", [p], None), ("si_stream_new", [], p),
                ("si_stream_delete", [p], None), ("si_stream_len", [p], i64), ("si_stream_tokens", [p, p], None),
                ("si_num_nodes", [p], i64),
                ("si_bytes", [p], i64), ("si_extend", [p, p, p, i64], ctypes.c_int), ("si_remove", [p, p], None),
                ("si_count", [p, p, i64], i64), ("si_match", [p, p, i64, p], i64),
                ("si_draft", [p, p, i64, i64, ctypes.c_double, ctypes.c_double, ctypes.c_double, i64, p, p], i64),
            ):
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, res
        _LIB.append(lib)
    return _LIB[0]


def native_available() -> bool:
    return _load() is not None


AnyStream = Union[Stream, "NativeStream"]  # each index takes the streams it made


def new_index(depth: int, native: bool | None = None) -> TokenIndex:
    """The C trie where it builds, else the Python one (``native``: False for the Python one anyway)."""
    return NativeSuffixIndex(depth) if native is not False and native_available() else SuffixIndex(depth)


class NativeStream:
    """A stream of a NativeSuffixIndex: its tokens and current suffixes live in C, freed with this object."""

    __slots__ = ("_lib", "ptr")

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self.ptr = lib.si_stream_new()
        if not self.ptr:
            raise MemoryError("suffix stream")

    def __len__(self) -> int:
        return self._lib.si_stream_len(self.ptr)

    @property
    def tokens(self) -> list[int]:
        """What is inserted so far (a copy)."""
        out = array("q", bytes(8 * len(self)))
        self._lib.si_stream_tokens(self.ptr, _address(out))
        return out.tolist()

    def __del__(self) -> None:
        if self.ptr:
            self._lib.si_stream_delete(self.ptr)
            self.ptr = None


def _address(values: array) -> int:
    return values.buffer_info()[0]


class NativeSuffixIndex:
    """SuffixIndex's interface over the C trie (node ids from ``match`` are the C trie's own)."""

    def __init__(self, depth: int = 24) -> None:
        if depth < 2:
            raise ValueError(f"depth must be >= 2, got {depth}")
        lib = _load()
        if lib is None:
            raise RuntimeError("the C suffix trie is not built on this machine")
        self._lib = lib
        self.depth = depth
        self._ptr = lib.si_new(depth)
        if not self._ptr:
            raise MemoryError("suffix index")
        self._out = array("q", bytes(8 * 64))  # a draft's tokens; grown to the longest limit asked
        self._score = ctypes.c_double()
        self._node = ctypes.c_int32()

    def __del__(self) -> None:
        if getattr(self, "_ptr", None):
            self._lib.si_delete(self._ptr)
            self._ptr = None

    @property
    def num_nodes(self) -> int:
        return self._lib.si_num_nodes(self._ptr)

    @property
    def nbytes(self) -> int:
        return self._lib.si_bytes(self._ptr)

    def stream(self) -> NativeStream:
        return NativeStream(self._lib)

    def extend(self, stream: NativeStream, tokens: list[int]) -> None:
        if not tokens:
            return
        values = array("q", tokens)
        if self._lib.si_extend(self._ptr, stream.ptr, _address(values), len(values)) != 0:
            raise MemoryError("suffix index: out of memory while inserting")

    def remove(self, stream: NativeStream) -> None:
        self._lib.si_remove(self._ptr, stream.ptr)

    def occurrences(self, path: list[int]) -> int:
        values = array("q", path)
        return self._lib.si_count(self._ptr, _address(values), len(values))

    def match(self, context: list[int]) -> tuple[int, int]:
        values = array("q", context[-self.depth:])
        m = self._lib.si_match(self._ptr, _address(values), len(values), ctypes.byref(self._node))
        return (self._node.value, m) if m else (NONE, 0)

    def draft(self, context: list[int], limit: int, min_prob: float, factor: float = 1.0, offset: float = 0.0,
              min_match: int = 1) -> tuple[list[int], float]:
        if limit > len(self._out):
            self._out = array("q", bytes(8 * limit))
        values = array("q", context[-self.depth:])
        k = self._lib.si_draft(self._ptr, _address(values), len(values), limit, min_prob, factor, offset, min_match,
                               _address(self._out), ctypes.byref(self._score))
        if k < 0:
            raise MemoryError("suffix index: out of memory while drafting")
        return self._out[:k].tolist(), self._score.value if k else 0.0
