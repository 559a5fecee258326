"""Validation of CUDA IPC buffer references (the GPU data path's wire format).

A client exports a CUDA storage once: the first reference to it carries the IPC
handles and a client-chosen export ``id``; later references carry only the id.
``drop`` lists ids whose storages died in the client (the daemon closes them).
"""

from __future__ import annotations

from typing import Any

from commd.protocol import schema as s

MAX_HANDLE_BYTES = 256
#: Export ids released with one reference at most (the client sends them as they die).
MAX_DROPS = 4096


class CudaRef:
    """A validated CUDA IPC buffer reference from a client message."""

    __slots__ = ("export_id", "device", "event", "handle", "size", "offset", "ref_handle", "ref_offset", "drop")

    def __init__(self, raw: dict[str, Any]) -> None:
        self.export_id = s.int_field(raw, "id", 1)
        self.device = s.int_field(raw, "device", 0, 1024)
        self.event = s.field(raw, "event", bytes)
        self.handle: bytes | None = None
        self.size = self.offset = self.ref_offset = 0
        self.ref_handle = b""
        if "handle" in raw:  # the first reference to this export: how to open it
            self.handle = s.field(raw, "handle", bytes)
            self.size = s.int_field(raw, "size", 0)
            self.offset = s.int_field(raw, "offset", 0)
            self.ref_handle = s.field(raw, "ref_handle", bytes)
            self.ref_offset = s.int_field(raw, "ref_offset", 0)
        for name in ("handle", "ref_handle", "event"):
            value = getattr(self, name)
            if value is not None and len(value) > MAX_HANDLE_BYTES:
                raise s.ProtocolError(f"CUDA field '{name}' is longer than {MAX_HANDLE_BYTES} bytes")
        drop = raw.get("drop", [])
        if not isinstance(drop, list) or len(drop) > MAX_DROPS or not all(type(x) is int and x > 0 for x in drop):
            raise s.ProtocolError(f"CUDA field 'drop' must be a list of at most {MAX_DROPS} positive export ids")
        self.drop: list[int] = drop
