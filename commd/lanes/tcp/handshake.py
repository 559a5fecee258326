"""Setting up the tcp lane's mesh: listening, dialing, and the mutual job-secret handshake.

The higher rank of each pair connects to the lower, which challenges it with a
random nonce; the connector answers with an HMAC-SHA256 over the job secret,
both ranks and both nonces, and the acceptor proves the secret back the same
way.  Anything else reaching the port is logged and dropped while the accept
loop goes on.  Each handshake is a generator of :class:`Read`/:class:`Write`
steps, driven by one selector loop (:meth:`MeshConnector.run`) together with
every other handshake, the listener and the retries, under one deadline.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import selectors
import socket
import struct
import time
from collections.abc import Generator
from typing import NamedTuple

from commd.lanes.base import LaneError
from commd.lanes.tcp.transport import SEND_FLAGS, Mesh

log = logging.getLogger("commd.lanes.tcp")

#: Pause before retrying an outgoing connection that was refused or failed (doubles, capped).
RETRY_FIRST_S, RETRY_MAX_S = 0.02, 0.5

HS_MAGIC = b"commdTL1"
NONCE_BYTES = 32
#: Acceptor -> connector: magic, acceptor nonce.
CHALLENGE = struct.Struct(f"!8s{NONCE_BYTES}s")
#: Connector -> acceptor: connector rank, acceptor rank, connector nonce, connector proof.
HELLO = struct.Struct(f"!II{NONCE_BYTES}s32s")
PROOF_BYTES = 32
CTX_CONNECTOR = b"commd tcp lane v1: connector proof"
CTX_ACCEPTOR = b"commd tcp lane v1: acceptor proof"


def proof(key: bytes, context: bytes, nnodes: int, acceptor: int, connector: int,
          nonce_a: bytes, nonce_c: bytes) -> bytes:
    """HMAC-SHA256 binding the secret to this job size, this pair (with roles) and these nonces."""
    msg = context + struct.pack("!III", nnodes, acceptor, connector) + nonce_a + nonce_c
    return hmac.new(key, msg, hashlib.sha256).digest()


def tune_socket(sock: socket.socket) -> None:
    """Latency over batching (headers and small messages), keepalive for silent deaths; non-blocking."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setblocking(False)


def listen(host: str, port: int, nnodes: int) -> socket.socket:
    """A non-blocking listening socket on ``host:port``; ValueError naming the address if that fails."""
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


class Read(NamedTuple):
    nbytes: int


class Write(NamedTuple):
    data: bytes


class Rejected(Exception):
    """A handshake that must not become a connection."""


Steps = Generator[Read | Write, bytes | None, int]


class Handshake:
    """A connection being set up, driven by a generator of Read/Write steps."""

    __slots__ = ("sock", "steps", "target", "addr", "connecting", "inbuf", "need", "outbuf")

    def __init__(self, sock: socket.socket, steps: Steps, target: int | None, addr: object) -> None:
        self.sock = sock
        self.steps = steps
        self.target = target  # the lower rank we dial, None for an accepted connection
        self.addr = addr
        self.connecting = target is not None
        self.inbuf = bytearray()
        self.need = 0
        self.outbuf = memoryview(b"")


class MeshConnector:
    """Fills ``mesh`` with an authenticated connection to every other node (see the module docstring)."""

    def __init__(self, node_rank: int, nnodes: int, key: bytes, listener: socket.socket,
                 wake: socket.socket, mesh: Mesh) -> None:
        self.node_rank = node_rank
        self.nnodes = nnodes
        self._key = key
        self._listener = listener
        self._wake = wake
        self._mesh = mesh

    def run(self, endpoints: list[tuple[str, int]], deadline: float, timeout: float) -> None:
        """Dial the lower ranks, accept the higher, until all are in the mesh; LaneError at the deadline
        (naming the nodes still missing) or when ``wake`` becomes readable (the lane was closed)."""
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
        sel.register(self._wake, selectors.EVENT_READ, "wake")
        sel.register(self._listener, selectors.EVENT_READ, "listen")
        retry_at = dict.fromkeys(addrs, 0.0)  # lower ranks to dial, and when
        backoff = dict.fromkeys(addrs, RETRY_FIRST_S)
        live: set[Handshake] = set()
        warned: set[int] = set()  # lower ranks already warned about (retries are then logged at debug)
        mesh = self._mesh

        def missing() -> list[int]:
            return [r for r in range(self.nnodes) if r != self.node_rank and r not in mesh.peers]

        def finish(hs: Handshake, *, retry: bool) -> None:
            live.discard(hs)
            try:
                sel.unregister(hs.sock)
            except (KeyError, ValueError):
                pass
            hs.sock.close()
            if retry and hs.target is not None:
                retry_at[hs.target] = time.monotonic() + backoff[hs.target]
                backoff[hs.target] = min(RETRY_MAX_S, 2 * backoff[hs.target])

        def failed(hs: Handshake, why: str, quiet: bool = False) -> None:
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

        def advance(hs: Handshake, value: bytes | None) -> None:
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
            except Rejected as exc:
                failed(hs, str(exc))
                return
            if isinstance(step, Read):
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
                            backoff[rank] = min(RETRY_MAX_S, 2 * backoff[rank])
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
                            hs.outbuf = hs.outbuf[hs.sock.send(hs.outbuf, SEND_FLAGS):]
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

    def _dial(self, sel: selectors.BaseSelector, rank: int, target: tuple) -> Handshake:
        """Start a non-blocking connect to lower node ``rank``; the selector reports when it is up."""
        family, kind, proto, addr = target
        sock = socket.socket(family, kind, proto)
        try:
            tune_socket(sock)
            err = sock.connect_ex(addr)  # normally EINPROGRESS: the outcome is SO_ERROR once writable
            if err not in (0, errno.EINPROGRESS, errno.EAGAIN, errno.EINTR):
                raise OSError(err, os.strerror(err))
        except OSError:
            sock.close()
            raise
        hs = Handshake(sock, self._connector_steps(rank), rank, addr)
        sel.register(sock, selectors.EVENT_WRITE, hs)
        return hs

    def _accept(self, sel: selectors.BaseSelector) -> list[Handshake]:
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
            tune_socket(sock)
            hs = Handshake(sock, self._acceptor_steps(), None, addr)
            sel.register(sock, selectors.EVENT_WRITE, hs)
            step = next(hs.steps)
            assert isinstance(step, Write)
            hs.outbuf = memoryview(step.data)
            new.append(hs)

    def _acceptor_steps(self) -> Steps:
        """Challenge, check the connector's proof and claimed rank, prove the secret back."""
        nonce_a = os.urandom(NONCE_BYTES)
        yield Write(CHALLENGE.pack(HS_MAGIC, nonce_a))
        raw = yield Read(HELLO.size)
        assert raw is not None
        claimed, target, nonce_c, mac = HELLO.unpack(raw)
        if target != self.node_rank or not self.node_rank < claimed < self.nnodes:
            raise Rejected(f"it claims to be node {claimed} dialing node {target}, which is not a higher "
                           f"node of this {self.nnodes}-node job dialing this one")
        expected = proof(self._key, CTX_CONNECTOR, self.nnodes, self.node_rank, claimed, nonce_a, nonce_c)
        if not hmac.compare_digest(mac, expected):
            raise Rejected(f"it claims to be node {claimed} but fails the job-secret check (wrong secret?)")
        if claimed in self._mesh.peers:
            raise Rejected(f"node {claimed} is already connected (duplicate)")
        yield Write(proof(self._key, CTX_ACCEPTOR, self.nnodes, self.node_rank, claimed, nonce_a, nonce_c))
        return claimed

    def _connector_steps(self, rank: int) -> Steps:
        """Answer ``rank``'s challenge with our proof, then check its proof of the secret."""
        raw = yield Read(CHALLENGE.size)
        assert raw is not None
        magic, nonce_a = CHALLENGE.unpack(raw)
        if magic != HS_MAGIC:
            raise Rejected(f"the peer does not speak the commd tcp lane protocol (got {magic!r})")
        nonce_c = os.urandom(NONCE_BYTES)
        mac = proof(self._key, CTX_CONNECTOR, self.nnodes, rank, self.node_rank, nonce_a, nonce_c)
        yield Write(HELLO.pack(self.node_rank, rank, nonce_c, mac))
        reply = yield Read(PROOF_BYTES)
        assert reply is not None
        expected = proof(self._key, CTX_ACCEPTOR, self.nnodes, rank, self.node_rank, nonce_a, nonce_c)
        if not hmac.compare_digest(reply, expected):
            raise Rejected(f"node {rank}'s answer fails the job-secret check")
        return rank
