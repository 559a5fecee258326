"""Export CUDA tensors to the node daemon as CUDA IPC handles (no host copy), once per storage.

A storage is exported with torch's own IPC sharing (``UntypedStorage._share_cuda_``:
memory handle, size, offset and the producer-side reference counter that keeps the
memory alive while the daemon holds it) the first time an op uses it, under an
export id; later ops name only the id.  When the storage dies its id is dropped
(sent with the next reference), so the daemon closes it and the producer's caching
allocator gets the block back: the same "register once, forget when it dies" idea
as a host storage registered as a segment.  Calling ``_share_cuda_`` per op instead
cost a new reference-counter slot each time and kept every block the daemon had
seen alive until the client left.

Stream order is kept with an interprocess event recorded on the caller's current
stream at submission: the daemon makes its stream wait on it before touching the
buffer, and synchronizes its stream before it answers, so the caller may use the
result as soon as the op completes.

The CPU counterpart is ``registry.py``: an ordinary CPU storage seen again is moved into a
sealed memfd once and registered as a segment, and forgotten when it dies.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

from commd.protocol.cuda import MAX_DROPS


class CudaExporter:
    """Per-client exporter: export ids per live storage, one interprocess event per device."""

    def __init__(self) -> None:
        self._events: dict[int, tuple[torch.cuda.Event, bytes]] = {}
        self._exports: weakref.WeakKeyDictionary[torch.UntypedStorage, tuple[int, int, int]] = (
            weakref.WeakKeyDictionary()
        )
        self._ids = itertools.count(1)
        self._dead: list[int] = []

    def _forget(self, export_id: int) -> None:
        self._dead.append(export_id)  # list.append is atomic: finalizers may run on any thread

    def export(self, tensor: torch.Tensor) -> dict[str, Any]:
        if not tensor.is_contiguous():
            raise ValueError("CUDA IPC export needs a contiguous tensor")
        storage = tensor.untyped_storage()
        device = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
        ref: dict[str, Any]
        known = self._exports.get(storage)
        if known is not None and known[1:] == (storage.data_ptr(), storage.nbytes()):
            ref = {"id": known[0], "device": device}
        else:
            if known is not None:  # resized in place: a new allocation behind the same storage
                self._forget(known[0])
            (dev, handle, size, offset, ref_handle, ref_offset, _event, _sync) = storage._share_cuda_()
            export_id = next(self._ids)
            self._exports[storage] = (export_id, storage.data_ptr(), storage.nbytes())
            weakref.finalize(storage, self._forget, export_id)
            ref = {
                "id": export_id, "device": int(dev), "handle": bytes(handle), "size": int(size),
                "offset": int(offset), "ref_handle": bytes(ref_handle) if ref_handle else b"",
                "ref_offset": int(ref_offset),
            }
        event_and_handle = self._events.get(device)
        if event_and_handle is None:
            event = torch.cuda.Event(interprocess=True)
            event_and_handle = self._events[device] = (event, bytes(event.ipc_handle()))
        event_and_handle[0].record(torch.cuda.current_stream(device))
        ref["event"] = event_and_handle[1]
        if self._dead:
            dead: list[int] = []
            while self._dead and len(dead) < MAX_DROPS:
                dead.append(self._dead.pop())  # pop is atomic against a finalizer appending
            ref["drop"] = dead
        return {
            "cuda": ref,
            "off": tensor.storage_offset() * tensor.element_size(),
            "n": tensor.numel() * tensor.element_size(),
        }
