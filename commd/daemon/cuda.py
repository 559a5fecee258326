"""The daemon's side of the GPU data path: open clients' CUDA IPC handles once.

Each (client, allocation) is opened on first use and cached for the client's
lifetime, as are the clients' interprocess events; ops run on one daemon
stream per device, which first waits on the client's event, and the daemon
synchronizes that stream before it answers.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from commd.execution.torch_loader import torch_module
from commd.protocol import schema as s
from commd.protocol.cuda import CudaRef

if TYPE_CHECKING:
    import torch

#: Device files of the GPU drivers torch.cuda can use (NVIDIA, AMD ROCm, WSL).  Without any of
#: them there is no GPU to open, and the daemon need not import torch to say so.
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def gpu_device_present() -> bool:
    """Whether this machine has a GPU driver's device file (torch decides whether it is usable)."""
    return any(os.path.exists(path) for path in GPU_DEVICE_FILES)


class CudaImporter:
    """Opens and caches CUDA IPC storages and events for the daemon.

    A storage is opened once per (client, export id) and kept until the client
    says its storage died (``drop``) or the client leaves: the same idea as a
    registered host storage (a segment), so holding it never pins memory the
    client has freed, and a new allocation at a recycled address is a new export.
    """

    def __init__(self) -> None:
        # (client, export id) -> [storage once opened, the export's reference, its size]
        self._storages: dict[tuple[int, int], list] = {}
        self._events: dict[tuple[int, bytes], torch.cuda.Event] = {}
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._device_files = gpu_device_present()

    def available(self) -> bool:
        return self._device_files and torch_module().cuda.is_available()

    def check(self, client_id: int, ref: CudaRef, offset: int, nbytes: int) -> None:
        """Validate a reference at submission, opening a new export and closing dropped ones (in order)."""
        if not self.available():
            raise s.ProtocolError("this daemon has no CUDA device: send host tensors", s.E_BOUNDS)
        if ref.device >= torch_module().cuda.device_count():
            raise s.ProtocolError(f"CUDA device {ref.device} does not exist on this node", s.E_BOUNDS)
        for export_id in ref.drop:
            self._storages.pop((client_id, export_id), None)
        key = (client_id, ref.export_id)
        if ref.handle is not None:
            if key in self._storages:
                raise s.ProtocolError(f"CUDA export {ref.export_id} is already open", s.E_BOUNDS)
            self._storages[key] = [None, ref, ref.size]  # opened on the worker that runs it, not on the loop
        cached = self._storages.get(key)
        if cached is None:
            raise s.ProtocolError(f"CUDA export {ref.export_id} is unknown (never exported or dropped)", s.E_BOUNDS)
        if offset + nbytes > cached[2]:
            raise s.ProtocolError(
                f"CUDA buffer [{offset}, {offset + nbytes}) lies outside its allocation of {cached[2]} bytes",
                s.E_BOUNDS,
            )

    def _open(self, ref: CudaRef) -> torch.UntypedStorage:
        torch = torch_module()
        try:
            torch.cuda.init()  # opening an IPC handle in a thread with no CUDA context yet crashed the daemon
            # The producer's interprocess event is passed per op (waited on below), so torch's own
            # per-storage event is not needed: an empty handle with event_sync_required False.
            return torch.UntypedStorage._new_shared_cuda(
                ref.device, ref.handle, ref.size, ref.offset, ref.ref_handle, ref.ref_offset, b"", False,
            )
        except (RuntimeError, TypeError) as exc:
            raise RuntimeError(f"cannot open CUDA export {ref.export_id}: {exc}") from None

    def tensor(self, client_id: int, ref: CudaRef, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        torch = torch_module()
        entry = self._storages[(client_id, ref.export_id)]
        if entry[0] is None:
            entry[0] = self._open(entry[1])
        storage = entry[0]
        event_key = (client_id, ref.event)
        event = self._events.get(event_key)
        if event is None:
            event = self._events[event_key] = torch.cuda.Event.from_ipc_handle(ref.device, ref.event)
        self.stream(ref.device).wait_event(event)
        flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{ref.device}").set_(storage)
        return flat[offset : offset + nbytes].view(dtype)

    def open_bytes(self, client_id: int) -> int:
        """Bytes of the client's CUDA exports this daemon holds open."""
        return sum(entry[2] for (owner, _), entry in self._storages.items() if owner == client_id)

    def stream(self, device: int) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch_module().cuda.Stream(device=device)
        return stream

    def synchronize(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()

    def forget_client(self, client_id: int) -> None:
        for key in [k for k in self._storages if k[0] == client_id]:
            del self._storages[key]
        for key in [k for k in self._events if k[0] == client_id]:
            del self._events[key]
