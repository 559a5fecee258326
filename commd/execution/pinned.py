"""Page-locked host memory for the copies between GPU buffers and the lanes, reused op after op.

A lane moves host memory, so a multi-node op on CUDA tensors copies them to the host and back.
Into ordinary (pageable) memory such a copy ran at about 1.2 GB/s on an H200 (64 MiB in 56 ms);
into page-locked memory at about 50 GB/s.  Page-locking is slow to set up, so each worker thread
keeps one arena, grown to the largest op it has staged, and hands out consecutive slices of it
for the length of one op.  Beyond ``MAX_ARENA_BYTES`` an op's copies go to pageable memory.
"""

from __future__ import annotations

import threading

import torch

#: The most page-locked memory one worker thread keeps (bytes).
MAX_ARENA_BYTES = 1 << 30
_ALIGN = 256


class PinnedArena:
    """One thread's page-locked buffer; ``start()`` at each op, then ``take(like)`` per staged tensor."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._used = 0
        self._wanted = 0  # the bytes the current op asked for: the size to grow to

    def start(self) -> None:
        """A new op: every slice handed out before is free again."""
        self._used = self._wanted = 0

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised host tensor of ``like``'s dtype and shape, page-locked when it fits."""
        nbytes = like.numel() * like.element_size()
        self._wanted += -(-nbytes // _ALIGN) * _ALIGN
        if self._buffer is None or self._used + nbytes > self._buffer.numel():
            if self._wanted > MAX_ARENA_BYTES:
                return torch.empty(like.shape, dtype=like.dtype)
            grown = max(self._wanted, 2 * (self._buffer.numel() if self._buffer is not None else 0), 1 << 20)
            # (slices already handed out keep the old buffer alive until their op ends)
            self._buffer = torch.empty(min(grown, MAX_ARENA_BYTES), dtype=torch.uint8, pin_memory=True)
            self._used = 0
        piece = self._buffer[self._used:self._used + nbytes]
        self._used += -(-nbytes // _ALIGN) * _ALIGN
        return piece.view(like.dtype).view(like.shape)


_local = threading.local()


def arena() -> PinnedArena:
    """This thread's arena."""
    found = getattr(_local, "arena", None)
    if found is None:
        found = _local.arena = PinnedArena()
    return found
