"""The node's clients (ranks) and their buffers.

``ClientRegistry`` knows who is connected (by control-socket identity and by client id)
and where the job's ranks live; ``BufferResolver`` turns a submission's buffer references
into tensors or arrays on the clients' shared memory, after ``check_bounds`` proved each
reference lies inside a segment its client registered.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from commd.core.ops import Submission
from commd.daemon.limits import PendingLedger
from commd.daemon.opchannel import OpConnection
from commd.execution import torch_loader
from commd.kernels.small import NUMPY_DTYPES
from commd.memory.arena import ARENA, Segment
from commd.protocol import schema as s

if TYPE_CHECKING:
    import torch

    from commd.daemon.cuda import CudaImporter


@dataclass
class ClientRecord:
    client_id: int
    identity: bytes
    rank: int
    local_rank: int
    world_size: int
    pid: int
    connected_at: float = field(default_factory=time.time)
    segments: dict[int, Segment] = field(default_factory=dict)
    views: dict[int, torch.Tensor] = field(default_factory=dict)  # made on first use (torch loads lazily)
    groups: dict[str, int] = field(default_factory=dict)  # group name -> group rank
    op_channel: OpConnection | None = None
    pending: PendingLedger = field(default_factory=PendingLedger)
    #: op id -> the registered segments that op uses (kept until the op is no longer pending)
    registered_ops: dict[int, tuple[int, ...]] = field(default_factory=dict)
    #: bytes of this client's accepted buffers by path (observe.stats.BUFFER_PATHS)
    bytes_by_path: dict[str, int] = field(default_factory=dict)

    @property
    def arena_bytes(self) -> int:
        return sum(seg.size for seg in self.segments.values() if seg.kind == ARENA)

    @property
    def registered_bytes(self) -> int:
        return sum(seg.size for seg in self.segments.values() if seg.kind != ARENA)


class ClientRegistry:
    """Connected clients, by control-socket identity and by client id; the job's placement."""

    def __init__(self) -> None:
        self.by_identity: dict[bytes, ClientRecord] = {}
        self.by_id: dict[int, ClientRecord] = {}
        self._next_id = 1
        #: Node rank of every global rank of the job (from the clients' hello); None until known.
        self.placement: list[int] | None = None
        self.had_clients = False
        self.idle_since = time.monotonic()

    def __len__(self) -> int:
        return len(self.by_identity)

    def __iter__(self) -> Iterator[ClientRecord]:
        return iter(list(self.by_identity.values()))

    def get(self, identity: bytes) -> ClientRecord | None:
        return self.by_identity.get(identity)

    def find(self, client_id: int) -> ClientRecord | None:
        return self.by_id.get(client_id)

    def current(self, client: ClientRecord) -> bool:
        """True while ``client`` is still the registered record for its id (not dropped)."""
        return self.by_id.get(client.client_id) is client

    def add(self, identity: bytes, rank: int, local_rank: int, world_size: int, pid: int,
            placement: list[int]) -> ClientRecord:
        client = ClientRecord(self._next_id, identity, rank, local_rank, world_size, pid)
        self._next_id += 1
        self.placement = placement
        self.by_identity[identity] = client
        self.by_id[client.client_id] = client
        self.had_clients = True
        return client

    def remove(self, client: ClientRecord) -> None:
        self.by_identity.pop(client.identity, None)
        self.by_id.pop(client.client_id, None)
        if not self.by_identity:
            self.idle_since = time.monotonic()

    def ranks(self) -> set[int]:
        return {c.rank for c in self.by_identity.values()}


class BufferResolver:
    """A submission's buffers as views of its client's memory (segments, inline bytes, CUDA IPC)."""

    def __init__(self, clients: ClientRegistry, cuda: CudaImporter) -> None:
        self.clients = clients
        self.cuda = cuda

    def check_bounds(self, client: ClientRecord, sub: Submission) -> None:
        """Every reference inside a segment the client registered, aligned to the dtype."""
        itemsize = s.ITEMSIZE[sub.dtype]
        buffers: Any = sub.buffers.items()
        if any(ref.cuda is not None for ref in sub.buffers.values()):
            # A CUDA export's first reference opens it: check those before the op's id-only references.
            buffers = sorted(buffers, key=lambda item: item[1].cuda is None or item[1].cuda.handle is None)
        for name, ref in buffers:
            if ref.inline is not None:
                continue
            if ref.cuda is not None:
                self.cuda.check(client.client_id, ref.cuda, ref.offset, ref.nbytes)
                continue
            segment = client.segments.get(ref.segment)
            if segment is None:
                raise s.ProtocolError(f"buffer '{name}' names unknown segment {ref.segment}", s.E_BOUNDS)
            if ref.offset + ref.nbytes > segment.size:
                raise s.ProtocolError(
                    f"buffer '{name}' [{ref.offset}, {ref.offset + ref.nbytes}) lies outside "
                    f"segment {ref.segment} of {segment.size} bytes",
                    s.E_BOUNDS,
                )
            if ref.offset % itemsize:
                raise s.ProtocolError(
                    f"buffer '{name}' offset {ref.offset} is not aligned to {sub.dtype}", s.E_BOUNDS
                )

    def resolve(self, sub: Submission, name: str) -> torch.Tensor:
        """The buffer as a torch tensor (KeyError: its client is gone)."""
        ref = sub.buffers[name]
        torch = torch_loader.torch_module()
        dtype = torch_loader.executor().torch_dtype(sub.dtype)
        if ref.nbytes == 0:
            return torch.empty(0, dtype=dtype)
        if ref.inline is not None:
            return torch.frombuffer(ref.inline, dtype=dtype)
        if ref.cuda is not None:
            return self.cuda.tensor(sub.client_id, ref.cuda, ref.offset, ref.nbytes, dtype)
        client = self.clients.by_id[sub.client_id]
        view = client.views.get(ref.segment)
        if view is None:
            segment = client.segments[ref.segment]
            view = client.views[ref.segment] = torch.frombuffer(segment.mm, dtype=torch.uint8, count=segment.size)
        return view[ref.offset : ref.offset + ref.nbytes].view(dtype)

    def resolve_array(self, sub: Submission, name: str) -> np.ndarray:
        """A CPU buffer as a NumPy array (KeyError: its client is gone)."""
        ref = sub.buffers[name]
        dtype = NUMPY_DTYPES[sub.dtype]
        if ref.inline is not None:
            return np.frombuffer(ref.inline, dtype=dtype)
        segment = self.clients.by_id[sub.client_id].segments[ref.segment]
        return segment.array[ref.offset : ref.offset + ref.nbytes].view(dtype)

    def release(self, client: ClientRecord) -> None:
        """Drop the client's mappings."""
        # Views still used by a running op keep their mapping alive; dropping
        # the references unmaps each segment once the last view is gone.
        client.views.clear()
        client.registered_ops.clear()
        self.cuda.forget_client(client.client_id)
        client.segments.clear()
