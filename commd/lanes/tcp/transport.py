"""The tcp lane's byte transport: a mesh of non-blocking sockets and the engine that moves bytes.

:class:`Mesh` owns one socket per peer (:class:`Peer`) and a ``selectors``
progress engine that advances any number of posted sends and receives at
once, straight from/into the tensors' memory, ``chunk_bytes`` per system call.
Every transfer carries a small header (magic, op kind, per-direction counter,
byte length), so two daemons whose streams got out of step fail loudly
instead of reading garbage.  :class:`Exchange` is one lane call's view of it
(its op kind and deadline) and implements :class:`commd.lanes.base.Transport`:
the tcp lane's algorithms, and later ones (programmable and compressed
collectives), run on it without reaching into anything here.
"""

from __future__ import annotations

import collections
import selectors
import socket
import struct
import time
from collections.abc import Iterable

from commd.lanes.base import Done, LaneError, TransportError

#: System calls one socket may make per wake-up before the others get their turn.
BURST = 16

#: Transfer header: magic, op kind, reserved, per-direction transfer counter, payload bytes.
HEADER = struct.Struct("!IHHQQ")
HEADER_MAGIC = 0x434D4454  # "CMDT"
#: Op kinds carried in the header, so two nodes running different ops are told apart.
KINDS = {"allreduce": 1, "broadcast": 2, "allgatherv": 3, "alltoallv": 4, "p2p": 5, "barrier": 6, "agree": 7}
KIND_NAMES = {v: k for k, v in KINDS.items()}

SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)  # a dead peer is an error, never a SIGPIPE


class Transfer:
    """One posted send or receive: header progress, payload progress, completion callback."""

    __slots__ = ("view", "size", "pos", "head", "hpos", "seq", "kind", "on_done")

    def __init__(self, view: memoryview, head: memoryview, seq: int, kind: int, on_done: Done | None) -> None:
        self.view = view
        self.size = len(view)
        self.pos = 0
        self.head = head
        self.hpos = 0
        self.seq = seq
        self.kind = kind
        self.on_done = on_done


class Peer:
    """The connection to one other node, its transfer counters and its queues (FIFO per direction)."""

    __slots__ = ("rank", "sock", "sent", "received", "sendq", "recvq", "events", "failure")

    def __init__(self, rank: int, sock: socket.socket) -> None:
        self.rank = rank
        self.sock: socket.socket | None = sock
        self.sent = 0  # transfers posted towards this peer (the header counter)
        self.received = 0  # transfers posted from this peer
        self.sendq: collections.deque[Transfer] = collections.deque()
        self.recvq: collections.deque[Transfer] = collections.deque()
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


class Mesh:
    """The connected peers and the progress engine that moves posted transfers among them.

    Used by one thread at a time (the lane's); ``wake`` lets another thread
    interrupt a wait (``TcpLane.close``).
    """

    def __init__(self, rank: int, chunk_bytes: int, wake: socket.socket) -> None:
        self.rank = rank
        self.chunk = chunk_bytes
        self.peers: dict[int, Peer] = {}
        self.sel = selectors.DefaultSelector()
        self.sel.register(wake, selectors.EVENT_READ, None)
        self._fresh: set[Peer] = set()  # peers given new transfers since the last pump
        self._busy: set[Peer] = set()  # peers with queued transfers

    def add(self, rank: int, sock: socket.socket) -> None:
        self.peers[rank] = Peer(rank, sock)

    def readable(self, rank: int) -> bool:
        """True if bytes from ``rank`` wait in the socket, unread (a peek: nothing is consumed)."""
        peer = self.peers.get(rank)
        if peer is None or peer.sock is None or peer.recvq:
            return False
        try:
            return bool(peer.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return False

    # ---- posting ------------------------------------------------------------------------
    def send(self, rank: int, view: memoryview, kind: int, on_done: Done | None = None) -> None:
        """Queue ``view`` for ``rank`` (after everything queued before it); ``on_done`` when all is out."""
        peer = self.peers[rank]
        head = memoryview(HEADER.pack(HEADER_MAGIC, kind, 0, peer.sent, len(view)))
        peer.sent += 1
        peer.sendq.append(Transfer(view, head, peer.sent - 1, kind, on_done))
        self._fresh.add(peer)
        self._busy.add(peer)

    def recv(self, rank: int, view: memoryview, kind: int, on_done: Done | None = None) -> None:
        """Queue a receive of exactly ``len(view)`` bytes from ``rank`` into ``view``."""
        peer = self.peers[rank]
        peer.received += 1
        peer.recvq.append(Transfer(view, memoryview(bytearray(HEADER.size)), peer.received - 1, kind, on_done))
        self._fresh.add(peer)
        self._busy.add(peer)

    # ---- progress -----------------------------------------------------------------------
    def wait(self, deadline: float, timeout: float) -> None:
        """Advance every queued transfer until all are done; TransportError on error, EOF or deadline."""
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
                raise TransportError(None, "timeout",
                                     f"timed out after {timeout:g} s, still waiting for "
                                     f"{', '.join(p.pending() for p in busy)}")
            for key, mask in self.sel.select(remaining):
                peer = key.data
                if peer is None:
                    raise TransportError(None, "internal", "the lane was closed")
                if mask & selectors.EVENT_WRITE and peer.sendq:
                    self._pump_send(peer)
                if mask & selectors.EVENT_READ and peer.recvq:
                    self._pump_recv(peer)

    def _watch(self, peer: Peer) -> None:
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

    def _pump_send(self, peer: Peer) -> None:
        """Write as much of ``peer``'s send queue as the socket takes now (bounded by BURST calls)."""
        sock, queue, chunk = peer.sock, peer.sendq, self.chunk
        assert sock is not None
        for _ in range(BURST):
            if not queue:
                return
            x = queue[0]
            try:
                if x.hpos < HEADER.size:
                    bufs = [x.head[x.hpos:], x.view[:chunk]] if x.size else [x.head[x.hpos:]]
                    n = sock.sendmsg(bufs, (), SEND_FLAGS)
                    h = min(n, HEADER.size - x.hpos)
                    x.hpos += h
                    x.pos += n - h
                else:
                    x.pos += sock.send(x.view[x.pos:x.pos + chunk], SEND_FLAGS)
            except BlockingIOError:
                return
            except OSError as exc:
                raise self._lost(peer, f"sending to node {peer.rank} failed: {exc}") from None
            if x.hpos == HEADER.size and x.pos == x.size:
                queue.popleft()
                if x.on_done is not None:
                    x.on_done()

    def _pump_recv(self, peer: Peer) -> None:
        """Read what ``peer`` has sent into the posted receives, in order, checking each header."""
        sock, queue, chunk = peer.sock, peer.recvq, self.chunk
        assert sock is not None
        for _ in range(BURST):
            if not queue:
                return
            x = queue[0]
            try:
                if x.hpos < HEADER.size:
                    bufs = [x.head[x.hpos:], x.view[:chunk]] if x.size else [x.head[x.hpos:]]
                    n = sock.recvmsg_into(bufs)[0]
                    if n:
                        h = min(n, HEADER.size - x.hpos)
                        x.hpos += h
                        x.pos += n - h
                        if x.hpos == HEADER.size:
                            self._check_header(peer, x)
                else:
                    n = sock.recv_into(x.view[x.pos:x.pos + chunk])
                    x.pos += n
            except BlockingIOError:
                return
            except OSError as exc:
                raise self._lost(peer, f"receiving from node {peer.rank} failed: {exc}") from None
            if n == 0:
                raise self._lost(peer, f"node {peer.rank} closed the connection ({x.pos}/{x.size} bytes of "
                                       f"transfer #{x.seq} received)")
            if x.hpos == HEADER.size and x.pos == x.size:
                queue.popleft()
                if x.on_done is not None:
                    x.on_done()

    @staticmethod
    def _check_header(peer: Peer, x: Transfer) -> None:
        """Fail loudly (not with garbage) when the two ends of a stream disagree."""
        magic, kind, _reserved, seq, size = HEADER.unpack(x.head)
        where = f"stream from node {peer.rank} out of step"
        if magic != HEADER_MAGIC:
            raise TransportError(peer.rank, "internal",
                                 f"{where}: bad header magic {magic:#010x} at transfer #{x.seq}")
        if seq != x.seq:
            raise TransportError(peer.rank, "internal", f"{where}: got transfer #{seq}, expected #{x.seq}")
        if kind != x.kind:
            raise TransportError(peer.rank, "internal",
                                 f"{where}: node {peer.rank} runs {KIND_NAMES.get(kind, kind)!r}, "
                                 f"this node {KIND_NAMES.get(x.kind, x.kind)!r} (transfer #{seq})")
        if size != x.size:
            raise TransportError(peer.rank, "internal",
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

    def lose(self, rank: int, error: LaneError) -> None:
        """Thread-safe: the node at ``rank`` is gone without closing its stream (the fabric declared
        it dead after a silence).  A call blocked on it, in any thread, fails now with ``error``
        (the socket is shut down, which wakes its selector); later calls are refused."""
        peer = self.peers.get(rank)
        if peer is None:
            return
        if peer.failure is None:
            peer.failure = error
        _shut(peer.sock)

    def _lost(self, peer: Peer, what: str) -> TransportError:
        """The error for ``what`` failing on ``peer``'s stream: the reason it was lost, when it was."""
        if peer.failure is not None:
            return TransportError(peer.rank, peer.failure.code, str(peer.failure))
        return TransportError(peer.rank, "peer_died", what)

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
            _shut(peer.sock)

    def close(self) -> None:
        self.drop_queues()
        for peer in self.peers.values():
            if peer.sock is not None:
                peer.sock.close()
                peer.sock = None
        self.sel.close()


class Exchange:
    """One lane call's handle on the mesh (its op kind and deadline): a :class:`~commd.lanes.base.Transport`."""

    __slots__ = ("_mesh", "_kind", "_deadline", "_timeout", "chunk_bytes")

    def __init__(self, mesh: Mesh, kind: str, deadline: float, timeout: float, chunk_bytes: int) -> None:
        self._mesh = mesh
        self._kind = KINDS[kind]
        self._deadline = deadline
        self._timeout = timeout
        self.chunk_bytes = chunk_bytes

    def post_send(self, peer: int, view: memoryview, done: Done | None = None) -> None:
        self._mesh.send(peer, view, self._kind, done)

    def post_recv(self, peer: int, view: memoryview, done: Done | None = None) -> None:
        self._mesh.recv(peer, view, self._kind, done)

    def wait(self) -> None:
        """Return when everything posted (including what completions post) is done."""
        self._mesh.wait(self._deadline, self._timeout)


def _shut(sock: socket.socket | None) -> None:
    """Make ``sock``'s pending and future I/O fail at once, in whatever thread waits on it."""
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
