"""A forward's index values, built on the host as plain lists, reach the device in one copy.

Each ``torch.tensor(list)`` or small index op costs several microseconds of dispatch on CPU, more with the
caches cold after a forward, and on CUDA ``torch.tensor(list, device=...)`` is a copy from pageable memory
that the host waits for. A step's attention layout took a few dozen of them. Here every value of a forward
goes into one flat list: on CPU one ``torch.tensor`` whose views are the layout's tensors; on CUDA one of
a rotating set of pinned staging buffers, copied with one non-blocking copy, so the host never waits.
"""

from __future__ import annotations

import torch

_ALIGN = 16  # elements: every view starts a multiple of 128 bytes in, as aligned as a fresh tensor
_TURNS = 8  # pinned buffers in rotation: a draft loop queues several forwards without a sync

Values = dict[str, tuple[list[int], tuple[int, ...]]]  # name -> flat int64 values and their shape


class Uploader:
    """Named int64 values as tensors on ``device``, each a view of the one buffer they travel in. The first sits
    at storage offset 0 and every other one at 16 or more: a compiled graph specialises on storage offsets (0, 1
    or more) as on sizes, so a caller keeps the order of its arrays from one forward to the next."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned: list[torch.Tensor | None] = [None] * _TURNS
        self._copied: list[torch.cuda.Event | None] = [None] * _TURNS
        self._turn = 0
        self._arange = torch.arange(4096, device=device)

    def __call__(self, values: Values) -> dict[str, torch.Tensor]:
        flat: list[int] = []
        offsets = []
        for v, _ in values.values():
            offsets.append(len(flat))
            flat += v
            flat += [0] * (-len(v) % _ALIGN)
        if self.device.type == "cpu":
            buf = torch.tensor(flat, dtype=torch.long)
        else:
            host = self._host(len(flat))
            host.numpy()[:] = flat
            buf = host.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._copied[self._turn] = event
        return {name: buf[o : o + len(v)].view(shape) for (name, (v, shape)), o in zip(values.items(), offsets)}

    def arange(self, n: int) -> torch.Tensor:
        """``torch.arange(n)`` on the device, a view of one kept tensor (grown when too short)."""
        if n > self._arange.numel():
            self._arange = torch.arange(2 * n, device=self.device)
        return self._arange[:n]

    def _host(self, n: int) -> torch.Tensor:
        """The next pinned buffer in rotation, ``n`` int64 long, once the copy out of it last time has finished."""
        self._turn = turn = (self._turn + 1) % _TURNS
        done = self._copied[turn]
        if done is not None:
            done.synchronize()  # queued _TURNS forwards ago: long finished in practice
        pinned = self._pinned[turn]
        if pinned is None or pinned.numel() < n:
            # Grown to twice the need: pinning memory is slow, so it happens a few times per process.
            pinned = self._pinned[turn] = torch.empty(max(2 * n, 4096), dtype=torch.long, pin_memory=True)
        return pinned[:n]
