"""Export CUDA tensors to the node daemon as CUDA IPC handles (no host copy).

A tensor's allocation is exported with torch's own IPC sharing
(``UntypedStorage._share_cuda_``: memory handle, size, offset and the
producer-side reference counter that keeps the memory alive while the daemon
holds it).  Stream order is kept with an interprocess event recorded on the
caller's current stream at submission: the daemon makes its stream wait on it
before touching the buffer, and synchronizes its stream before it answers, so
the caller may use the result as soon as the op completes.

The same idea as ``registry.py`` for ordinary CPU tensors: memory the user allocated is made
visible to the daemon once per allocation (the daemon caches each opened IPC handle; the registry
caches each registered storage) and named in place by every later op.
"""

from __future__ import annotations

from typing import Any

import torch


class CudaExporter:
    """Per-client exporter; one reusable interprocess event per device."""

    def __init__(self) -> None:
        self._events: dict[int, torch.cuda.Event] = {}

    def export(self, tensor: torch.Tensor) -> dict[str, Any]:
        if not tensor.is_contiguous():
            raise ValueError("CUDA IPC export needs a contiguous tensor")
        storage = tensor.untyped_storage()
        (device, handle, size, offset, ref_handle, ref_offset, _event, _sync) = storage._share_cuda_()
        event = self._events.get(device)
        if event is None:
            event = self._events[device] = torch.cuda.Event(interprocess=True)
        event.record(torch.cuda.current_stream(device))
        return {
            "cuda": {
                "device": int(device),
                "handle": bytes(handle),
                "size": int(size),
                "offset": int(offset),
                "ref_handle": bytes(ref_handle) if ref_handle else b"",
                "ref_offset": int(ref_offset),
                "event": bytes(event.ipc_handle()),
            },
            "off": tensor.storage_offset() * tensor.element_size(),
            "n": tensor.numel() * tensor.element_size(),
        }
