"""Validation of CUDA IPC buffer references (the GPU data path's wire format)."""

from __future__ import annotations

from typing import Any

from commd.protocol import schema as s

MAX_HANDLE_BYTES = 256


class CudaRef:
    """A validated CUDA IPC buffer reference from a client message."""

    __slots__ = ("device", "handle", "size", "offset", "ref_handle", "ref_offset", "event")

    def __init__(self, raw: dict[str, Any]) -> None:
        self.device = s.int_field(raw, "device", 0, 1024)
        self.handle = s.field(raw, "handle", bytes)
        self.size = s.int_field(raw, "size", 0)
        self.offset = s.int_field(raw, "offset", 0)
        self.ref_handle = s.field(raw, "ref_handle", bytes)
        self.ref_offset = s.int_field(raw, "ref_offset", 0)
        self.event = s.field(raw, "event", bytes)
        for name in ("handle", "ref_handle", "event"):
            if len(getattr(self, name)) > MAX_HANDLE_BYTES:
                raise s.ProtocolError(f"CUDA field '{name}' is longer than {MAX_HANDLE_BYTES} bytes")
