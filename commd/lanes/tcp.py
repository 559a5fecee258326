"""commd's own TCP lane: a full mesh of authenticated connections between the daemons.

Two layers, kept apart so that later algorithms (an interpreter, chunked
chains) can reuse the transport:

* transport: :class:`_Mesh` owns one non-blocking socket per peer
  (:class:`_Peer`) and a ``selectors`` progress engine that advances any
  number of posted sends and receives at once, straight from/into the
  tensors' memory, ``chunk_bytes`` per system call.  Every transfer carries a
  small header (magic, op kind, per-direction counter, byte length), so two
  daemons whose streams got out of step fail loudly instead of reading garbage.
  :class:`_Exchange` is one call's view of it (its kind and deadline).
* algorithms: plain functions over an :class:`_Exchange` (``_ring``,
  ``_chain_broadcast``, ``_pairwise_alltoallv`` ...), chosen by size in
  :class:`TcpLane`, which also does the argument checks and the failure
  bookkeeping the :class:`~commd.lanes.base.Lane` contract asks for.

Connections are made once, by :meth:`TcpLane.connect`: the higher rank of
each pair connects to the lower, which challenges it with a random nonce; the
connector answers with an HMAC-SHA256 over the job secret, both ranks and
both nonces, and the acceptor proves the secret back the same way.  Anything
else reaching the port is logged and dropped while the accept loop goes on.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import hmac
import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Generator, Iterable
from typing import NamedTuple

import torch

from commd.kernels.reduce import DTYPE_NAMES, UnsupportedReduction, check_supported, reduce_into
from commd.lanes.base import LaneError, check_nodes, refusal

log = logging.getLogger("commd.lanes.tcp")

#: All-reduces of at most this many bytes exchange whole buffers (one round trip, every node
#: reduces all contributions in node order); larger ones use the ring (bandwidth-optimal).
SMALL_ALLREDUCE_BYTES = 64 * 1024
#: Broadcasts of at most this many bytes go from the root to each node directly; larger ones
#: take the pipelined chain.
SMALL_BROADCAST_BYTES = 64 * 1024
#: Smallest accepted ``chunk_bytes`` (below this the per-chunk overhead dominates everything).
MIN_CHUNK_BYTES = 256
#: System calls one socket may make per wake-up before the others get their turn.
_BURST = 16
#: Pause before retrying an outgoing connection that was refused or failed (doubles, capped).
_RETRY_FIRST_S, _RETRY_MAX_S = 0.02, 0.5

# ---- wire formats -----------------------------------------------------------------------
#: Transfer header: magic, op kind, reserved, per-direction transfer counter, payload bytes.
_HEADER = struct.Struct("!IHHQQ")
_HEADER_MAGIC = 0x434D4454  # "CMDT"
#: Op kinds carried in the header, so two nodes running different ops are told apart.
_KINDS = {"allreduce": 1, "broadcast": 2, "allgatherv": 3, "alltoallv": 4, "p2p": 5, "barrier": 6}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}

_HS_MAGIC = b"commdTL1"
_NONCE_BYTES = 32
#: Acceptor -> connector: magic, acceptor nonce.
_CHALLENGE = struct.Struct(f"!8s{_NONCE_BYTES}s")
#: Connector -> acceptor: connector rank, acceptor rank, connector nonce, connector proof.
_HELLO = struct.Struct(f"!II{_NONCE_BYTES}s32s")
_PROOF_BYTES = 32
_CTX_CONNECTOR = b"commd tcp lane v1: connector proof"
_CTX_ACCEPTOR = b"commd tcp lane v1: acceptor proof"

_SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)  # a dead peer is an error, never a SIGPIPE


def _proof(key: bytes, context: bytes, nnodes: int, acceptor: int, connector: int,
           nonce_a: bytes, nonce_c: bytes) -> bytes:
    """HMAC-SHA256 binding the secret to this job size, this pair (with roles) and these nonces."""
    msg = context + struct.pack("!III", nnodes, acceptor, connector) + nonce_a + nonce_c
    return hmac.new(key, msg, hashlib.sha256).digest()


def _tune(sock: socket.socket) -> None:
    """Latency over batching (headers and small messages), keepalive for silent deaths; non-blocking."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setblocking(False)


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable, zero-copy byte view of a flat contiguous CPU tensor of any dtype."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:  # may carry any stride (NumPy's empty arrays give 0), which view() refuses
        return memoryview(bytearray())
    if flat.stride(0) != 1:  # a one-element tensor counts as contiguous whatever its stride
        flat = flat.as_strided((flat.numel(),), (1,))
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy())


# ==== transport ==============================================================================


class _Failure(Exception):
    """A transport failure inside one call: the peer at fault (if one), a LaneError code, why."""

    def __init__(self, rank: int | None, code: str, message: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.code = code
        self.message = message


class _Xfer:
    """One posted send or receive: header progress, payload progress, completion callback."""

    __slots__ = ("view", "size", "pos", "head", "hpos", "seq", "kind", "on_done")

    def __init__(self, view: memoryview, head: memoryview, seq: int, kind: int,
                 on_done: Callable[[], None] | None) -> None:
        self.view = view
        self.size = len(view)
        self.pos = 0
        self.head = head
        self.hpos = 0
        self.seq = seq
        self.kind = kind
        self.on_done = on_done


class _Peer:
    """The connection to one other node, its transfer counters and its queues (FIFO per direction)."""

    __slots__ = ("rank", "sock", "sent", "received", "sendq", "recvq", "events", "failure")

    def __init__(self, rank: int, sock: socket.socket) -> None:
        self.rank = rank
        self.sock: socket.socket | None = sock
        self.sent = 0  # transfers posted towards this peer (the header counter)
        self.received = 0  # transfers posted from this peer
        self.sendq: collections.deque[_Xfer] = collections.deque()
        self.recvq: collections.deque[_Xfer] = collections.deque()
        self.events = 0  # what the selector currently watches for
        self.failure: LaneError | None = None  # the first failure that made the stream unusable

    def pending(self) -> str:
        """What is still outstanding with this peer, for timeout messages."""
        parts = []
        if self.recvq:
            x = self.recvq[0]
            parts.append(f"receiving {len(self.recvq)} transfer(s), the current one "
                         f"{x.pos}/{x.size} bytes in")
        if self.sendq:
            x = self.sendq[0]
            parts.append(f"sending {len(self.sendq)} transfer(s), the current one {x.pos}/{x.size} bytes out")
        return f"node {self.rank} ({'; '.join(parts)})"


class _Mesh:
    """The connected peers and the progress engine that moves posted transfers among them.

    Used by one thread at a time (the lane's); ``wake`` lets another thread
    interrupt a wait (``TcpLane.close``).
    """

    def __init__(self, rank: int, chunk_bytes: int, wake: socket.socket) -> None:
        self.rank = rank
        self.chunk = chunk_bytes
        self.peers: dict[int, _Peer] = {}
        self.sel = selectors.DefaultSelector()
        self.sel.register(wake, selectors.EVENT_READ, None)
        self._fresh: set[_Peer] = set()  # peers given new transfers since the last pump
        self._busy: set[_Peer] = set()  # peers with queued transfers

    def add(self, rank: int, sock: socket.socket) -> None:
        self.peers[rank] = _Peer(rank, sock)

    # ---- posting ------------------------------------------------------------------------
    def send(self, rank: int, view: memoryview, kind: int, on_done: Callable[[], None] | None = None) -> None:
        """Queue ``view`` for ``rank`` (after everything queued before it); ``on_done`` when all is out."""
        peer = self.peers[rank]
        head = memoryview(_HEADER.pack(_HEADER_MAGIC, kind, 0, peer.sent, len(view)))
        peer.sent += 1
        peer.sendq.append(_Xfer(view, head, peer.sent - 1, kind, on_done))
        self._fresh.add(peer)
        self._busy.add(peer)

    def recv(self, rank: int, view: memoryview, kind: int, on_done: Callable[[], None] | None = None) -> None:
        """Queue a receive of exactly ``len(view)`` bytes from ``rank`` into ``view``."""
        peer = self.peers[rank]
        peer.received += 1
        peer.recvq.append(_Xfer(view, memoryview(bytearray(_HEADER.size)), peer.received - 1, kind, on_done))
        self._fresh.add(peer)
        self._busy.add(peer)

    # ---- progress -----------------------------------------------------------------------
    def wait(self, deadline: float, timeout: float) -> None:
        """Advance every queued transfer until all are done; raise _Failure on error, EOF or deadline."""
        while True:
            while self._fresh:  # try new work at once: usually saves a trip through the selector
                peer = self._fresh.pop()
                if peer.sendq:
                    self._pump_send(peer)
                if peer.recvq:
                    self._pump_recv(peer)
            for peer in list(self._busy):
                self._watch(peer)
            if not self._busy:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                busy = sorted(self._busy, key=lambda p: p.rank)
                raise _Failure(None, "timeout",
                               f"timed out after {timeout:g} s, still waiting for "
                               f"{', '.join(p.pending() for p in busy)}")
            for key, mask in self.sel.select(remaining):
                peer = key.data
                if peer is None:
                    raise _Failure(None, "internal", "the lane was closed")
                if mask & selectors.EVENT_WRITE and peer.sendq:
                    self._pump_send(peer)
                if mask & selectors.EVENT_READ and peer.recvq:
                    self._pump_recv(peer)

    def _watch(self, peer: _Peer) -> None:
        """Make the selector watch exactly what ``peer`` still needs (level-triggered: never more)."""
        want = (selectors.EVENT_READ if peer.recvq else 0) | (selectors.EVENT_WRITE if peer.sendq else 0)
        if want == peer.events:
            if not want:
                self._busy.discard(peer)
            return
        assert peer.sock is not None
        if not peer.events:
            self.sel.register(peer.sock, want, peer)
        elif not want:
            self.sel.unregister(peer.sock)
            self._busy.discard(peer)
        else:
            self.sel.modify(peer.sock, want, peer)
        peer.events = want

    def _pump_send(self, peer: _Peer) -> None:
        """Write as much of ``peer``'s send queue as the socket takes now (bounded by _BURST calls)."""
        sock, queue, chunk = peer.sock, peer.sendq, self.chunk
        assert sock is not None
        for _ in range(_BURST):
            if not queue:
                return
            x = queue[0]
            try:
                if x.hpos < _HEADER.size:
                    bufs = [x.head[x.hpos:], x.view[:chunk]] if x.size else [x.head[x.hpos:]]
                    n = sock.sendmsg(bufs, (), _SEND_FLAGS)
                    h = min(n, _HEADER.size - x.hpos)
                    x.hpos += h
                    x.pos += n - h
                else:
                    x.pos += sock.send(x.view[x.pos:x.pos + chunk], _SEND_FLAGS)
            except BlockingIOError:
                return
            except OSError as exc:
                raise _Failure(peer.rank, "peer_died", f"sending to node {peer.rank} failed: {exc}") from None
            if x.hpos == _HEADER.size and x.pos == x.size:
                queue.popleft()
                if x.on_done is not None:
                    x.on_done()

    def _pump_recv(self, peer: _Peer) -> None:
        """Read what ``peer`` has sent into the posted receives, in order, checking each header."""
        sock, queue, chunk = peer.sock, peer.recvq, self.chunk
        assert sock is not None
        for _ in range(_BURST):
            if not queue:
                return
            x = queue[0]
            try:
                if x.hpos < _HEADER.size:
                    bufs = [x.head[x.hpos:], x.view[:chunk]] if x.size else [x.head[x.hpos:]]
                    n = sock.recvmsg_into(bufs)[0]
                    if n:
                        h = min(n, _HEADER.size - x.hpos)
                        x.hpos += h
                        x.pos += n - h
                        if x.hpos == _HEADER.size:
                            self._check_header(peer, x)
                else:
                    n = sock.recv_into(x.view[x.pos:x.pos + chunk])
                    x.pos += n
            except BlockingIOError:
                return
            except OSError as exc:
                raise _Failure(peer.rank, "peer_died",
                               f"receiving from node {peer.rank} failed: {exc}") from None
            if n == 0:
                raise _Failure(peer.rank, "peer_died",
                               f"node {peer.rank} closed the connection ({x.pos}/{x.size} bytes of transfer "
                               f"#{x.seq} received)")
            if x.hpos == _HEADER.size and x.pos == x.size:
                queue.popleft()
                if x.on_done is not None:
                    x.on_done()

    @staticmethod
    def _check_header(peer: _Peer, x: _Xfer) -> None:
        """Fail loudly (not with garbage) when the two ends of a stream disagree."""
        magic, kind, _reserved, seq, size = _HEADER.unpack(x.head)
        where = f"stream from node {peer.rank} out of step"
        if magic != _HEADER_MAGIC:
            raise _Failure(peer.rank, "internal",
                           f"{where}: bad header magic {magic:#010x} at transfer #{x.seq}")
        if seq != x.seq:
            raise _Failure(peer.rank, "internal", f"{where}: got transfer #{seq}, expected #{x.seq}")
        if kind != x.kind:
            raise _Failure(peer.rank, "internal",
                           f"{where}: node {peer.rank} runs {_KIND_NAMES.get(kind, kind)!r}, "
                           f"this node {_KIND_NAMES.get(x.kind, x.kind)!r} (transfer #{seq})")
        if size != x.size:
            raise _Failure(peer.rank, "internal",
                           f"{where}: node {peer.rank} sends {size} bytes in transfer #{seq}, "
                           f"this node expects {x.size} (do the sizes agree?)")

    # ---- failures and shutdown ----------------------------------------------------------
    def drop_queues(self) -> None:
        """Forget every posted transfer (after a failure: the buffers belong to the caller again)."""
        for peer in self.peers.values():
            peer.sendq.clear()
            peer.recvq.clear()
            if peer.events and peer.sock is not None:
                self.sel.unregister(peer.sock)
            peer.events = 0
        self._fresh.clear()
        self._busy.clear()

    def break_peers(self, ranks: Iterable[int], error: LaneError) -> None:
        """Mark the streams to ``ranks`` unusable and close them (the peers then fail fast too)."""
        self.drop_queues()
        for rank in ranks:
            peer = self.peers[rank]
            if peer.failure is None:
                peer.failure = error
            if peer.sock is not None:
                peer.sock.close()
                peer.sock = None

    def shutdown(self) -> None:
        """Thread-safe part of closing: make every socket's pending and future I/O fail at once."""
        for peer in list(self.peers.values()):
            sock = peer.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.drop_queues()
        for peer in self.peers.values():
            if peer.sock is not None:
                peer.sock.close()
                peer.sock = None
        self.sel.close()


class _Exchange:
    """One lane call's handle on the mesh: its op kind, deadline and chunk size for the algorithms."""

    def __init__(self, mesh: _Mesh, kind: str, deadline: float, timeout: float, chunk: int) -> None:
        self._mesh = mesh
        self._kind = _KINDS[kind]
        self._deadline = deadline
        self._timeout = timeout
        self.chunk = chunk

    def send(self, rank: int, view: memoryview, on_done: Callable[[], None] | None = None) -> None:
        self._mesh.send(rank, view, self._kind, on_done)

    def recv(self, rank: int, view: memoryview, on_done: Callable[[], None] | None = None) -> None:
        self._mesh.recv(rank, view, self._kind, on_done)

    def wait(self) -> None:
        """Return when everything posted (including what completions post) is done."""
        self._mesh.wait(self._deadline, self._timeout)


# ==== connection set-up ======================================================================


class _Read(NamedTuple):
    nbytes: int


class _Write(NamedTuple):
    data: bytes


class _Rejected(Exception):
    """A handshake that must not become a connection."""


_Steps = Generator[_Read | _Write, bytes | None, int]


class _Handshake:
    """A connection being set up, driven by a generator of _Read/_Write steps (see TcpLane.connect)."""

    __slots__ = ("sock", "steps", "target", "addr", "connecting", "inbuf", "need", "outbuf")

    def __init__(self, sock: socket.socket, steps: _Steps, target: int | None, addr: object) -> None:
        self.sock = sock
        self.steps = steps
        self.target = target  # the lower rank we dial, None for an accepted connection
        self.addr = addr
        self.connecting = target is not None
        self.inbuf = bytearray()
        self.need = 0
        self.outbuf = memoryview(b"")


# ==== algorithms =============================================================================


def _chunks(offset: int, length: int, chunk: int) -> list[tuple[int, int]]:
    """(offset, length) pieces of at most ``chunk`` bytes covering [offset, offset + length)."""
    return [(offset + s, min(chunk, length - s)) for s in range(0, length, chunk)]


def _ring(ex: _Exchange, nxt: int, prv: int, me: int, view: memoryview, blocks: list[tuple[int, int]],
          steps: int, chunk: int, combine: Callable[[int, int], None] | None = None,
          scratch: memoryview | None = None, combine_steps: int = 0) -> None:
    """Pipelined ring over byte ``blocks`` of ``view`` (block i starts at ring position i).

    Step t sends block (me - t) to ``nxt`` and receives block (me - t - 1) from
    ``prv``, chunk by chunk; a received chunk is forwarded at step t + 1 as soon
    as it is complete, so the chunks stream round the ring.  For the first
    ``combine_steps`` steps a chunk lands in ``scratch`` and ``combine(offset,
    length)`` folds it into ``view`` before it goes on (reduce-scatter); later
    chunks land in place (all-gather).

    One scratch chunk is enough: receives from ``prv`` complete strictly in
    order and each is folded in by its completion callback before the next one
    reads a byte.  Receiving in place is safe too: a block comes back to a node
    only after the ring has consumed what the node sent from that place.
    """
    n = len(blocks)

    def received(t: int, off: int, length: int) -> Callable[[], None]:
        def done() -> None:
            if t < combine_steps:
                assert combine is not None
                combine(off, length)
            if t + 1 < steps:
                ex.send(nxt, view[off:off + length])
        return done

    for off, length in _chunks(*blocks[me % n], chunk):
        ex.send(nxt, view[off:off + length])
    for t in range(steps):
        for off, length in _chunks(*blocks[(me - t - 1) % n], chunk):
            target = scratch[:length] if t < combine_steps and scratch is not None else view[off:off + length]
            ex.recv(prv, target, received(t, off, length))
    ex.wait()


def _ring_allreduce(ex: _Exchange, nodes: tuple[int, ...], me: int, flat: torch.Tensor, op: str) -> None:
    """Ring reduce-scatter then ring all-gather: each segment is reduced along the ring and the
    finished bytes go round from their owner, so every node ends with the same bits."""
    n, numel, es = len(nodes), flat.numel(), flat.element_size()
    base, rem = divmod(numel, n)
    blocks = [((k * base + min(k, rem)) * es, (base + (k < rem)) * es) for k in range(n)]
    chunk = max(es, ex.chunk // es * es)
    scratch = torch.empty(chunk // es, dtype=flat.dtype)

    def combine(off: int, length: int) -> None:
        out = flat[off // es:(off + length) // es]
        reduce_into(out, [out, scratch[:length // es]], op)

    _ring(ex, nodes[(me + 1) % n], nodes[(me - 1) % n], me, _byte_view(flat), blocks, 2 * (n - 1), chunk,
          combine, _byte_view(scratch), n - 1)


def _direct_allreduce(ex: _Exchange, nodes: tuple[int, ...], me: int, flat: torch.Tensor, op: str) -> None:
    """Everyone sends its whole buffer to everyone; each reduces all contributions in node order."""
    parts = [flat if i == me else torch.empty_like(flat) for i in range(len(nodes))]
    mine = _byte_view(flat)
    for i, node in enumerate(nodes):
        if i != me:
            ex.send(node, mine)
            ex.recv(node, _byte_view(parts[i]))
    ex.wait()
    if me > 1:  # reduce_into lets ``out`` alias only inputs[0] or inputs[1]
        parts[me] = flat.clone()
    reduce_into(flat, parts, op)


def _direct_broadcast(ex: _Exchange, nodes: tuple[int, ...], me: int, root: int, view: memoryview) -> None:
    """Root sends to each node itself: one hop, for small messages."""
    if nodes[me] == root:
        for node in nodes:
            if node != root:
                ex.send(node, view)
    else:
        ex.recv(root, view)
    ex.wait()


def _chain_broadcast(ex: _Exchange, nodes: tuple[int, ...], me: int, root: int, view: memoryview) -> None:
    """Chunked chain from ``root`` along ``nodes`` (rotated to start there): node k forwards chunk c
    while it receives chunk c + 1, so the time is ~size/bandwidth + (n - 2) chunks."""
    r = nodes.index(root)
    order = nodes[r:] + nodes[:r]
    q = order.index(nodes[me])
    nxt = order[q + 1] if q + 1 < len(order) else None
    pieces = _chunks(0, len(view), ex.chunk)
    if q == 0:
        assert nxt is not None
        for off, length in pieces:
            ex.send(nxt, view[off:off + length])
    else:
        for off, length in pieces:
            piece = view[off:off + length]
            forward = (lambda p=piece: ex.send(nxt, p)) if nxt is not None else None
            ex.recv(order[q - 1], piece, forward)
    ex.wait()


def _ring_allgatherv(ex: _Exchange, nodes: tuple[int, ...], me: int, inp: memoryview, out: memoryview,
                     sizes: list[int]) -> None:
    """Own block into place, then n - 1 pipelined ring steps forwarding the others' blocks."""
    n = len(nodes)
    offsets = [sum(sizes[:i]) for i in range(n)]
    out[offsets[me]:offsets[me] + sizes[me]] = inp
    blocks = list(zip(offsets, sizes, strict=True))
    _ring(ex, nodes[(me + 1) % n], nodes[(me - 1) % n], me, out, blocks, n - 1, ex.chunk)


def _pairwise_alltoallv(ex: _Exchange, nodes: tuple[int, ...], me: int, inp: memoryview, in_sizes: list[int],
                        out: memoryview, out_sizes: list[int]) -> None:
    """Own block copied; step s sends to (me + s) and receives from (me - s), one pair at a time."""
    n = len(nodes)
    in_off = [sum(in_sizes[:i]) for i in range(n)]
    out_off = [sum(out_sizes[:i]) for i in range(n)]
    out[out_off[me]:out_off[me] + out_sizes[me]] = inp[in_off[me]:in_off[me] + in_sizes[me]]
    for s in range(1, n):
        dst, src = (me + s) % n, (me - s) % n
        if in_sizes[dst]:
            ex.send(nodes[dst], inp[in_off[dst]:in_off[dst] + in_sizes[dst]])
        if out_sizes[src]:
            ex.recv(nodes[src], out[out_off[src]:out_off[src] + out_sizes[src]])
        ex.wait()


def _point_to_point(post: Callable[[int, memoryview], None], peer: int, view: memoryview,
                    ex: _Exchange) -> None:
    """One direct transfer (the engine still moves it ``chunk_bytes`` per system call)."""
    post(peer, view)
    ex.wait()


def _dissemination_barrier(ex: _Exchange, nodes: tuple[int, ...], me: int) -> None:
    """ceil(log2 n) rounds of empty messages at distance 1, 2, 4 ...: after the last round every
    node has (transitively) heard from every other one."""
    n, empty, d = len(nodes), memoryview(b""), 1
    while d < n:
        ex.send(nodes[(me + d) % n], empty)
        ex.recv(nodes[(me - d) % n], memoryview(bytearray(0)))
        ex.wait()
        d *= 2


# ==== the lane ===============================================================================


class TcpLane:
    """commd's own inter-node lane: point-to-point TCP between the job's daemons.

    Single-threaded by contract (the daemon's tcp lane thread), except
    ``close``, which may come from any thread and makes a pending call fail.
    """

    name = "tcp"

    def __init__(self, node_rank: int, nnodes: int, secret: str, host: str, port: int = 0,
                 chunk_bytes: int = 1 << 20) -> None:
        for what, value in (("node_rank", node_rank), ("nnodes", nnodes), ("port", port),
                            ("chunk_bytes", chunk_bytes)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{what} must be an int, got {value!r}")
        if nnodes < 1:
            raise ValueError(f"nnodes must be at least 1, got {nnodes}")
        if not 0 <= node_rank < nnodes:
            raise ValueError(f"node_rank {node_rank} is not in [0, {nnodes})")
        if not isinstance(secret, str) or not secret:
            raise ValueError("secret must be a non-empty string (the job secret)")
        if not isinstance(host, str) or not host:
            raise ValueError(f"host must be a non-empty string, got {host!r}")
        if not 0 <= port <= 65535:
            raise ValueError(f"port {port} is not in [0, 65535]")
        if chunk_bytes < MIN_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be at least {MIN_CHUNK_BYTES}, got {chunk_bytes}")
        self.node_rank = node_rank
        self.nnodes = nnodes
        self.chunk_bytes = chunk_bytes
        self._key = secret.encode()
        self._listener = self._listen(host, port, nnodes)
        name = self._listener.getsockname()
        self._endpoint: tuple[str, int] = (str(name[0]), int(name[1]))
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._mesh = _Mesh(node_rank, chunk_bytes, self._wake_r)
        self._connected = False
        self._connect_error: LaneError | None = None
        self._closed = False
        self._op_lock = threading.Lock()  # one call at a time; close() waits for it to let go

    @staticmethod
    def _listen(host: str, port: int, nnodes: int) -> socket.socket:
        try:
            family, kind, proto, _, addr = socket.getaddrinfo(
                host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)[0]
            sock = socket.socket(family, kind, proto)
        except OSError as exc:
            raise ValueError(f"cannot listen on {host}:{port}: {exc}") from None
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(max(64, 2 * nnodes))
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise ValueError(f"cannot listen on {host}:{port}: {exc}") from None
        return sock

    @property
    def endpoint(self) -> tuple[str, int]:
        """The (host, port) the listening socket is bound to (the real port when 0 was asked)."""
        return self._endpoint

    def __repr__(self) -> str:
        state = "closed" if self._closed else "connected" if self._connected else "unconnected"
        host, port = self._endpoint
        return f"<TcpLane node {self.node_rank}/{self.nnodes} at {host}:{port}, {state}>"

    # ---- connecting ---------------------------------------------------------------------
    def connect(self, endpoints: list[tuple[str, int]], timeout: float) -> None:
        """Connect to every other node (dial the lower ranks, accept the higher) within ``timeout`` s.

        Raises LaneError("timeout") naming the nodes still missing; a failed
        connect leaves the lane unusable.
        """
        if len(endpoints) != self.nnodes:
            raise LaneError(f"tcp connect: {len(endpoints)} endpoints given for {self.nnodes} nodes")
        if timeout <= 0:
            raise LaneError(f"tcp connect: timeout must be positive, got {timeout}")
        with self._op_lock:
            if self._closed:
                raise LaneError("tcp lane is closed")
            if self._connected or self._connect_error is not None:
                raise LaneError("tcp connect: already called on this lane")
            try:
                self._connect(endpoints, time.monotonic() + timeout, timeout)
            except LaneError as exc:
                self._connect_error = exc
                self._mesh.close()
                raise
            finally:
                self._listener.close()
            self._connected = True

    def _connect(self, endpoints: list[tuple[str, int]], deadline: float, timeout: float) -> None:
        addrs = {}
        for rank in range(self.node_rank):
            host, port = endpoints[rank]
            try:
                family, kind, proto, _, addr = socket.getaddrinfo(host, port, socket.AF_UNSPEC,
                                                                  socket.SOCK_STREAM)[0]
            except (OSError, UnicodeError) as exc:
                raise LaneError(f"tcp connect: cannot resolve node {rank}'s endpoint {host}:{port}: "
                                f"{exc}") from None
            addrs[rank] = (family, kind, proto, addr)
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        sel.register(self._listener, selectors.EVENT_READ, "listen")
        retry_at = dict.fromkeys(addrs, 0.0)  # lower ranks to dial, and when
        backoff = dict.fromkeys(addrs, _RETRY_FIRST_S)
        live: set[_Handshake] = set()
        warned: set[int] = set()  # lower ranks already warned about (retries are then logged at debug)
        mesh = self._mesh

        def missing() -> list[int]:
            return [r for r in range(self.nnodes) if r != self.node_rank and r not in mesh.peers]

        def finish(hs: _Handshake, *, retry: bool) -> None:
            live.discard(hs)
            try:
                sel.unregister(hs.sock)
            except (KeyError, ValueError):
                pass
            hs.sock.close()
            if retry and hs.target is not None:
                retry_at[hs.target] = time.monotonic() + backoff[hs.target]
                backoff[hs.target] = min(_RETRY_MAX_S, 2 * backoff[hs.target])

        def failed(hs: _Handshake, why: str, quiet: bool = False) -> None:
            if hs.target is None:
                log.warning("tcp lane node %d: rejected a connection from %s: %s",
                            self.node_rank, hs.addr, why)
            else:
                (log.debug if quiet or hs.target in warned else log.warning)(
                    "tcp lane node %d: connecting to node %d at %s failed (will retry): %s",
                    self.node_rank, hs.target, hs.addr, why)
                if not quiet:
                    warned.add(hs.target)
            finish(hs, retry=True)

        def advance(hs: _Handshake, value: bytes | None) -> None:
            try:
                step = hs.steps.send(value)
            except StopIteration as stop:
                rank = stop.value
                if rank in mesh.peers:  # two valid handshakes raced for one rank
                    failed(hs, f"node {rank} is already connected")
                    return
                live.discard(hs)
                sel.unregister(hs.sock)
                mesh.add(rank, hs.sock)
                log.debug("tcp lane node %d: connected to node %d (%s)", self.node_rank, rank, hs.addr)
                return
            except _Rejected as exc:
                failed(hs, str(exc))
                return
            if isinstance(step, _Read):
                hs.need, hs.inbuf = step.nbytes, bytearray()
                sel.modify(hs.sock, selectors.EVENT_READ, hs)
            else:
                hs.outbuf = memoryview(step.data)
                sel.modify(hs.sock, selectors.EVENT_WRITE, hs)

        try:
            while missing():
                now = time.monotonic()
                if now >= deadline:
                    gone = missing()
                    raise LaneError(f"tcp connect: node(s) {', '.join(map(str, gone))} did not connect "
                                    f"to node {self.node_rank} within {timeout:g} s", "timeout")
                for rank, when in list(retry_at.items()):
                    if rank in mesh.peers:
                        del retry_at[rank]
                    elif when <= now:
                        del retry_at[rank]
                        try:
                            live.add(self._dial(sel, rank, addrs[rank]))
                        except OSError as exc:
                            log.debug("tcp lane node %d: dialing node %d failed (will retry): %s",
                                      self.node_rank, rank, exc)
                            retry_at[rank] = now + backoff[rank]
                            backoff[rank] = min(_RETRY_MAX_S, 2 * backoff[rank])
                wake_at = min([deadline, *(w for w in retry_at.values())])
                for key, mask in sel.select(max(0.0, wake_at - now)):
                    if key.data == "wake":
                        raise LaneError("tcp connect: the lane was closed")
                    if key.data == "listen":
                        live.update(self._accept(sel))
                        continue
                    hs = key.data
                    if hs not in live:
                        continue
                    try:
                        if hs.connecting:
                            err = hs.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                            if err:
                                quiet = err in (errno.ECONNREFUSED, errno.ECONNRESET)
                                failed(hs, os.strerror(err), quiet=quiet)
                                continue
                            hs.connecting = False
                            advance(hs, None)
                        elif mask & selectors.EVENT_READ:
                            data = hs.sock.recv(hs.need - len(hs.inbuf))
                            if not data:
                                failed(hs, "connection closed during the handshake"
                                       + (" (is the secret right?)" if hs.target is not None else ""))
                                continue
                            hs.inbuf += data
                            if len(hs.inbuf) == hs.need:
                                advance(hs, bytes(hs.inbuf))
                        elif mask & selectors.EVENT_WRITE:
                            hs.outbuf = hs.outbuf[hs.sock.send(hs.outbuf, _SEND_FLAGS):]
                            if not hs.outbuf:
                                advance(hs, None)
                    except BlockingIOError:
                        continue
                    except OSError as exc:
                        failed(hs, str(exc), quiet=hs.target is not None)
        finally:
            for hs in list(live):
                finish(hs, retry=False)
            sel.close()

    def _dial(self, sel: selectors.BaseSelector, rank: int, target: tuple) -> _Handshake:
        """Start a non-blocking connect to lower node ``rank``; the selector reports when it is up."""
        family, kind, proto, addr = target
        sock = socket.socket(family, kind, proto)
        try:
            _tune(sock)
            err = sock.connect_ex(addr)  # normally EINPROGRESS: the outcome is SO_ERROR once writable
            if err not in (0, errno.EINPROGRESS, errno.EAGAIN, errno.EINTR):
                raise OSError(err, os.strerror(err))
        except OSError:
            sock.close()
            raise
        hs = _Handshake(sock, self._connector_steps(rank), rank, addr)
        sel.register(sock, selectors.EVENT_WRITE, hs)
        return hs

    def _accept(self, sel: selectors.BaseSelector) -> list[_Handshake]:
        """Take every waiting connection and start its challenge."""
        new = []
        while True:
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return new
            except OSError as exc:  # e.g. EMFILE: keep going, the deadline bounds us
                log.warning("tcp lane node %d: accept failed: %s", self.node_rank, exc)
                return new
            _tune(sock)
            hs = _Handshake(sock, self._acceptor_steps(), None, addr)
            sel.register(sock, selectors.EVENT_WRITE, hs)
            step = next(hs.steps)
            assert isinstance(step, _Write)
            hs.outbuf = memoryview(step.data)
            new.append(hs)

    def _acceptor_steps(self) -> _Steps:
        """Challenge, check the connector's proof and claimed rank, prove the secret back."""
        nonce_a = os.urandom(_NONCE_BYTES)
        yield _Write(_CHALLENGE.pack(_HS_MAGIC, nonce_a))
        raw = yield _Read(_HELLO.size)
        assert raw is not None
        claimed, target, nonce_c, mac = _HELLO.unpack(raw)
        if target != self.node_rank or not self.node_rank < claimed < self.nnodes:
            raise _Rejected(f"it claims to be node {claimed} dialing node {target}, which is not a higher "
                            f"node of this {self.nnodes}-node job dialing this one")
        expected = _proof(self._key, _CTX_CONNECTOR, self.nnodes, self.node_rank, claimed, nonce_a, nonce_c)
        if not hmac.compare_digest(mac, expected):
            raise _Rejected(f"it claims to be node {claimed} but fails the job-secret check (wrong secret?)")
        if claimed in self._mesh.peers:
            raise _Rejected(f"node {claimed} is already connected (duplicate)")
        yield _Write(_proof(self._key, _CTX_ACCEPTOR, self.nnodes, self.node_rank, claimed, nonce_a, nonce_c))
        return claimed

    def _connector_steps(self, rank: int) -> _Steps:
        """Answer ``rank``'s challenge with our proof, then check its proof of the secret."""
        raw = yield _Read(_CHALLENGE.size)
        assert raw is not None
        magic, nonce_a = _CHALLENGE.unpack(raw)
        if magic != _HS_MAGIC:
            raise _Rejected(f"the peer does not speak the commd tcp lane protocol (got {magic!r})")
        nonce_c = os.urandom(_NONCE_BYTES)
        mac = _proof(self._key, _CTX_CONNECTOR, self.nnodes, rank, self.node_rank, nonce_a, nonce_c)
        yield _Write(_HELLO.pack(self.node_rank, rank, nonce_c, mac))
        reply = yield _Read(_PROOF_BYTES)
        assert reply is not None
        expected = _proof(self._key, _CTX_ACCEPTOR, self.nnodes, rank, self.node_rank, nonce_a, nonce_c)
        if not hmac.compare_digest(reply, expected):
            raise _Rejected(f"node {rank}'s answer fails the job-secret check")
        return rank

    # ---- capability and plumbing ----------------------------------------------------------
    def can_run(
        self, primitive: str, dtype: str, reduce_op: str | None, nodes: tuple[int, ...]
    ) -> str | None:
        """None if this lane runs ``primitive`` on ``dtype``/``reduce_op`` among ``nodes``; else why not.

        A pure function of its arguments (the coordinator asks it for every
        daemon), so it says nothing about the state of connections.
        """
        reason = refusal("tcp", primitive, dtype, reduce_op, nodes, self.nnodes)
        if reason is not None or primitive != "allreduce":
            return reason
        try:
            check_supported(reduce_op, dtype)
        except UnsupportedReduction as exc:
            return str(exc)
        return None

    def _check_nodes(self, what: str, nodes: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
        """Normalised ``nodes`` and this node's index in it; LaneError if they make no sense."""
        nodes = check_nodes("tcp", what, nodes, self.node_rank, self.nnodes)
        return nodes, nodes.index(self.node_rank)

    @staticmethod
    def _check_tensor(what: str, tensor: torch.Tensor, uint8: bool = False) -> None:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise LaneError(f"tcp {what}: tensors must be contiguous and on the CPU, got {tensor.device}")
        if uint8 and tensor.dtype != torch.uint8:
            raise LaneError(f"tcp {what}: expected a uint8 tensor, got {tensor.dtype}")

    def _usable(self, what: str, nodes: tuple[int, ...]) -> None:
        """Refuse at once when closed, unconnected, or a peer's stream broke earlier."""
        if self._closed:
            raise LaneError(f"tcp lane is closed ({what} on nodes {nodes})")
        if self._connect_error is not None:
            raise LaneError(f"tcp lane unusable ({what}): connect failed: {self._connect_error}",
                            self._connect_error.code)
        if not self._connected and len(nodes) > 1:
            raise LaneError(f"tcp {what}: the lane is not connected yet")
        for rank in nodes:
            peer = self._mesh.peers.get(rank)
            if peer is not None and peer.failure is not None:
                raise LaneError(f"tcp lane refuses {what} on nodes {nodes}: the stream to node {rank} is "
                                f"unusable since an earlier failure: {peer.failure}", peer.failure.code)

    def _run(self, what: str, kind: str, nodes: tuple[int, ...], timeout: float,
             body: Callable[[_Exchange], None]) -> None:
        """Run one call's transfers under its deadline; on failure mark the call's peers unusable.

        Every peer of the call is marked, not only the one at fault: the others
        may be part-way through a transfer, so their streams are out of step too.
        """
        deadline = time.monotonic() + timeout
        if not self._op_lock.acquire(timeout=max(0.0, timeout)):
            raise LaneError(f"tcp {what}: another call on this lane did not finish in time", "timeout")
        try:
            self._usable(what, nodes)
            try:
                body(_Exchange(self._mesh, kind, deadline, timeout, self.chunk_bytes))
            except _Failure as failure:
                self._failed(what, nodes, failure.code, failure.message)
            except LaneError:
                raise
            except Exception as exc:
                self._failed(what, nodes, "internal", f"{type(exc).__name__}: {exc}", exc)
        finally:
            self._op_lock.release()

    def _failed(self, what: str, nodes: tuple[int, ...], code: str, message: str,
                cause: BaseException | None = None) -> None:
        if self._closed:
            self._mesh.drop_queues()
            raise LaneError(f"tcp lane closed during {what} on nodes {nodes}") from cause
        error = LaneError(f"tcp {what} on nodes {nodes} failed: {message}", code)
        self._mesh.break_peers([n for n in nodes if n != self.node_rank], error)
        log.debug("tcp lane node %d: %s", self.node_rank, error)
        raise error from cause

    # ---- primitives -----------------------------------------------------------------------
    def allreduce(self, nodes: tuple[int, ...], buf: torch.Tensor, op: str, timeout: float) -> None:
        """In-place reduction over ``nodes``: whole-buffer exchange when small, ring when large."""
        nodes, me = self._check_nodes("allreduce", nodes)
        self._check_tensor("allreduce", buf)
        dtype = DTYPE_NAMES.get(buf.dtype, str(buf.dtype))
        reason = self.can_run("allreduce", dtype, op, nodes)
        if reason is not None:
            raise LaneError(f"tcp allreduce: {reason}")
        flat = buf.detach().reshape(-1)
        if len(nodes) == 1 or flat.numel() == 0:
            self._usable("allreduce", nodes)
            return
        nbytes = flat.numel() * flat.element_size()
        algo = _direct_allreduce if nbytes <= SMALL_ALLREDUCE_BYTES else _ring_allreduce
        self._run(f"allreduce({dtype}, {op}, {nbytes} bytes)", "allreduce", nodes, timeout,
                  lambda ex: algo(ex, nodes, me, flat, op))

    def broadcast(self, nodes: tuple[int, ...], buf: torch.Tensor, root: int, timeout: float) -> None:
        """``root``'s bytes into everyone's ``buf``: direct when small, pipelined chain when large."""
        nodes, me = self._check_nodes("broadcast", nodes)
        self._check_tensor("broadcast", buf)
        if root not in nodes:
            raise LaneError(f"tcp broadcast: root {root} is not in {nodes}")
        view = _byte_view(buf)
        if len(nodes) == 1 or len(view) == 0:
            self._usable("broadcast", nodes)
            return
        algo = _direct_broadcast if len(view) <= SMALL_BROADCAST_BYTES else _chain_broadcast
        self._run(f"broadcast(root {root}, {len(view)} bytes)", "broadcast", nodes, timeout,
                  lambda ex: algo(ex, nodes, me, root, view))

    def allgatherv(
        self, nodes: tuple[int, ...], inp: torch.Tensor, out: torch.Tensor, sizes: list[int], timeout: float
    ) -> None:
        """Every node's ``inp`` bytes, in node order, into everyone's ``out`` (pipelined ring)."""
        nodes, me = self._check_nodes("allgatherv", nodes)
        self._check_tensor("allgatherv", inp, uint8=True)
        self._check_tensor("allgatherv", out, uint8=True)
        sizes = [int(s) for s in sizes]
        src, dst = _byte_view(inp), _byte_view(out)
        if (len(sizes) != len(nodes) or min(sizes, default=0) < 0 or len(src) != sizes[me]
                or len(dst) != sum(sizes)):
            raise LaneError(f"tcp allgatherv: sizes {sizes} do not match nodes {nodes}, "
                            f"inp {len(src)} bytes and out {len(dst)} bytes")
        if len(nodes) == 1 or sum(sizes) == 0:
            self._usable("allgatherv", nodes)
            dst[:] = src
            return
        self._run(f"allgatherv({sum(sizes)} bytes)", "allgatherv", nodes, timeout,
                  lambda ex: _ring_allgatherv(ex, nodes, me, src, dst, sizes))

    def alltoallv(
        self,
        nodes: tuple[int, ...],
        inp: torch.Tensor,
        in_sizes: list[int],
        out: torch.Tensor,
        out_sizes: list[int],
        timeout: float,
    ) -> None:
        """Personalised exchange of byte blocks, pairwise (step s: to me + s, from me - s)."""
        nodes, me = self._check_nodes("alltoallv", nodes)
        self._check_tensor("alltoallv", inp, uint8=True)
        self._check_tensor("alltoallv", out, uint8=True)
        in_sizes, out_sizes = [int(s) for s in in_sizes], [int(s) for s in out_sizes]
        src, dst = _byte_view(inp), _byte_view(out)
        if (len(in_sizes) != len(nodes) or len(out_sizes) != len(nodes) or min(in_sizes + out_sizes) < 0
                or len(src) != sum(in_sizes) or len(dst) != sum(out_sizes)):
            raise LaneError(f"tcp alltoallv: in_sizes {in_sizes} / out_sizes {out_sizes} do not match "
                            f"nodes {nodes}, inp {len(src)} bytes and out {len(dst)} bytes")
        if len(nodes) == 1:
            self._usable("alltoallv", nodes)
            dst[:] = src
            return
        self._run(f"alltoallv({len(src)} bytes out, {len(dst)} in)", "alltoallv", nodes, timeout,
                  lambda ex: _pairwise_alltoallv(ex, nodes, me, src, in_sizes, dst, out_sizes))

    def _pair(self, what: str, peer: int) -> tuple[int, ...]:
        if peer == self.node_rank:
            raise LaneError(f"tcp {what}: node {peer} is this node")
        return self._check_nodes(what, tuple(sorted((self.node_rank, int(peer)))))[0]

    def send(self, dst: int, buf: torch.Tensor, timeout: float) -> None:
        """``buf``'s bytes to ``dst`` (returns once they are handed to the kernel)."""
        nodes = self._pair(f"send to {dst}", dst)
        self._check_tensor("send", buf)
        view = _byte_view(buf)
        if len(view) == 0:
            self._usable(f"send to {dst}", nodes)
            return
        self._run(f"send to {dst} ({len(view)} bytes)", "p2p", nodes, timeout,
                  lambda ex: _point_to_point(ex.send, dst, view, ex))

    def recv(self, src: int, buf: torch.Tensor, timeout: float) -> None:
        """Exactly ``buf``'s size in bytes from ``src``, straight into ``buf``."""
        nodes = self._pair(f"recv from {src}", src)
        self._check_tensor("recv", buf)
        view = _byte_view(buf)
        if len(view) == 0:
            self._usable(f"recv from {src}", nodes)
            return
        self._run(f"recv from {src} ({len(view)} bytes)", "p2p", nodes, timeout,
                  lambda ex: _point_to_point(ex.recv, src, view, ex))

    def barrier(self, nodes: tuple[int, ...], timeout: float) -> None:
        """Return once every node of ``nodes`` has entered (dissemination: log2 rounds of headers)."""
        nodes, me = self._check_nodes("barrier", nodes)
        if len(nodes) == 1:
            self._usable("barrier", nodes)
            return
        self._run("barrier", "barrier", nodes, timeout, lambda ex: _dissemination_barrier(ex, nodes, me))

    def close(self) -> None:
        """Close every socket; a pending call fails with LaneError, later calls are refused.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._mesh.shutdown()  # a call stuck anywhere in a socket operation fails now
        if self._op_lock.acquire(timeout=10.0):
            try:
                self._mesh.close()
                self._listener.close()
                self._wake_r.close()
                self._wake_w.close()
            finally:
                self._op_lock.release()
        else:  # a call is still in progress and did not notice: leave the fds to the GC
            log.warning("tcp lane node %d: closed while a call was still running", self.node_rank)
