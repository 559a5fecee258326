"""Where pending ops will write into user tensors when they complete, by byte range.

A staged or inline output is copied into the user's tensor only when its op's reply
arrives.  A later op that copies memory in (or moves a storage into shared memory) must
first let such a write land there — program order, as on any backend — but only where
the two overlap: receives into different slices of one buffer, posted together (a
``batch_isend_irecv`` between two ranks that each receive before they send), must not
wait for each other, or both ranks would wait for a send the other has not posted yet.

The ranges hold their ops weakly: a pending op is held by the client (or its exchange ring) until it
completes, so a handle that is gone has completed, and a completed op's handle must not live on here
with its result (the user's output tensor) after the user dropped both.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

#: The tracked storages are swept of completed writes when there are more than this many.
PURGE_STORAGES = 256

#: (storage address, first byte, end byte) of a tensor's memory.
Span = tuple[int, int, int]


def span(tensor: torch.Tensor) -> Span:
    """The bytes ``tensor`` covers inside its storage (every byte from its first to its last element)."""
    start = tensor.data_ptr()
    itemsize = tensor.element_size()
    if tensor.is_contiguous():
        end = start + tensor.numel() * itemsize
    elif tensor.numel() == 0:
        end = start
    else:
        end = start + (sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride(), strict=True)) + 1) * itemsize
    return tensor.untyped_storage().data_ptr(), start, end


def _done(ref: weakref.ref) -> bool:
    handle = ref()
    return handle is None or handle.is_completed()


class PendingWrites:
    """Byte ranges that pending ops write when they complete, per storage (any handle with
    ``is_completed`` that can be weakly referenced)."""

    def __init__(self) -> None:
        self._by_storage: dict[int, list[tuple[int, int, weakref.ref]]] = {}
        self._sweep_at = PURGE_STORAGES

    def __bool__(self) -> bool:
        return bool(self._by_storage)

    def note(self, where: Span, handle: Any) -> None:
        """``handle``'s op writes ``where`` when it completes."""
        storage, start, end = where
        writes = self._by_storage.get(storage)
        if writes is None:
            if len(self._by_storage) >= self._sweep_at:
                self._sweep()
            writes = self._by_storage[storage] = []
        elif _done(writes[0][2]):
            writes[:] = [w for w in writes if not _done(w[2])]
        writes.append((start, end, weakref.ref(handle)))

    def writers(self, tensor: torch.Tensor, whole_storage: bool = False) -> list[Any]:
        """The pending ops that write into ``tensor``'s bytes (``whole_storage``: anywhere in its
        storage); forgets those already completed."""
        storage = tensor.untyped_storage().data_ptr()
        writes = self._by_storage.get(storage)
        if writes is None:
            return []
        live = [(write, handle) for write in writes if (handle := write[2]()) is not None and not handle.is_completed()]
        if not live:
            del self._by_storage[storage]
            return []
        writes[:] = [write for write, _ in live]
        if whole_storage:
            return [handle for _, handle in live]
        _, start, end = span(tensor)
        return [handle for (first, last, _), handle in live if first < end and start < last]

    def _sweep(self) -> None:
        for storage, writes in list(self._by_storage.items()):
            writes[:] = [w for w in writes if not _done(w[2])]
            if not writes:
                del self._by_storage[storage]
        self._sweep_at = max(PURGE_STORAGES, 2 * len(self._by_storage))
