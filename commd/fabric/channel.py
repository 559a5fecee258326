"""The control channel between a daemon and the coordinator: length-prefixed msgpack on TCP.

Plain sockets driven by the daemon's event loop rather than ZeroMQ: a ZeroMQ
message passes through an I/O thread on each side, and on nodes whose cores
the training ranks keep busy every thread wake-up costs tens of microseconds
(measured here: ZeroMQ round trip 51 µs, TCP 8 µs, both idle).  The
negotiation of every multi-node op crosses this channel, so it is on the
critical path.  A closed connection is also an immediate sign of a dead peer.

This module moves maps; what they say is elsewhere: after the join
(``rendezvous.py``), every frame is a batch of the typed messages of
``protocol/fabric.py``.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from commd.protocol import schema as s

_HEADER = struct.Struct("!I")
#: A control frame larger than this is a protocol violation (negotiation batches are small).
MAX_FRAME = 16 * s.MAX_MESSAGE_BYTES


class ChannelClosed(ConnectionError):
    """The peer closed the connection or broke the framing."""


class Connection:
    """One control connection; blocking helpers for the join, loop-driven I/O afterwards."""

    def __init__(self, sock: socket.socket) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self.sock = sock
        self._rx = bytearray()
        self._tx = bytearray()
        self.closed = False
        self._loop: Any = None
        self._on_message: Callable[[dict[str, Any]], None] | None = None
        self._on_close: Callable[[str], None] | None = None

    # ---- blocking use (rendezvous) ---------------------------------------------
    def send_blocking(self, message: dict[str, Any]) -> None:
        self.sock.setblocking(True)
        self.sock.sendall(frame(message))

    def recv_blocking(self, deadline: float) -> dict[str, Any] | None:
        """The next message, or None if the deadline passes first."""
        while True:
            message = self._pop()
            if message is not None:
                return message
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select([self.sock], [], [], remaining)
            if ready:
                data = self.sock.recv(1 << 16)
                if not data:
                    raise ChannelClosed("connection closed by the peer")
                self._rx += data

    def poll_message(self) -> dict[str, Any] | None:
        """Read what is available (the socket is readable) and return a complete message, if any."""
        data = self.sock.recv(1 << 16)
        if not data:
            raise ChannelClosed("connection closed by the peer")
        self._rx += data
        return self._pop()

    def _pop(self) -> dict[str, Any] | None:
        if len(self._rx) < _HEADER.size:
            return None
        (length,) = _HEADER.unpack_from(self._rx)
        if length > MAX_FRAME:
            raise ChannelClosed(f"control frame of {length} bytes exceeds {MAX_FRAME}")
        if len(self._rx) < _HEADER.size + length:
            return None
        body = bytes(self._rx[_HEADER.size : _HEADER.size + length])
        del self._rx[: _HEADER.size + length]
        try:
            return s.decode(body) if length <= s.MAX_MESSAGE_BYTES else _decode_large(body)
        except s.ProtocolError as exc:
            raise ChannelClosed(f"bad control message: {exc}") from None

    # ---- event-loop use ------------------------------------------------------------
    def attach(self, loop: Any, on_message: Callable[[dict[str, Any]], None], on_close: Callable[[str], None]) -> None:
        self._loop, self._on_message, self._on_close = loop, on_message, on_close
        self.sock.setblocking(False)
        loop.add_reader(self.sock.fileno(), self._readable)
        if self._rx:
            loop.call_soon(self._deliver)

    def send(self, message: dict[str, Any]) -> None:
        if self.closed:
            return
        data = frame(message)
        if not self._tx:
            try:
                sent = self.sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                self._close(f"send failed: {exc}")
                return
            data = data[sent:]
            if not data:
                return
            self._loop.add_writer(self.sock.fileno(), self._writable)
        self._tx += data

    def _writable(self) -> None:
        try:
            sent = self.sock.send(self._tx)
        except BlockingIOError:
            return
        except OSError as exc:
            self._close(f"send failed: {exc}")
            return
        del self._tx[:sent]
        if not self._tx:
            self._loop.remove_writer(self.sock.fileno())

    def _readable(self) -> None:
        try:
            data = self.sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError as exc:
            self._close(f"receive failed: {exc}")
            return
        if not data:
            self._close("connection closed by the peer")
            return
        self._rx += data
        self._deliver()

    def _deliver(self) -> None:
        while not self.closed:
            try:
                message = self._pop()
            except ChannelClosed as exc:
                self._close(str(exc))
                return
            if message is None:
                return
            self._on_message(message)

    def _close(self, why: str) -> None:
        if self.closed:
            return
        self.close()
        if self._on_close is not None:
            self._on_close(why)

    def close(self) -> None:
        """Flush what is queued (best effort) and close."""
        if self.closed:
            return
        self.closed = True
        if self._loop is not None:
            try:
                self._loop.remove_reader(self.sock.fileno())
                self._loop.remove_writer(self.sock.fileno())
            except Exception:  # the loop may already be closed
                pass
        if self._tx:
            try:
                self.sock.setblocking(True)
                self.sock.settimeout(0.5)
                self.sock.sendall(self._tx)
            except OSError:
                pass
        self.sock.close()


def frame(message: dict[str, Any]) -> bytes:
    body = s.encode(message)
    return _HEADER.pack(len(body)) + body


def _decode_large(body: bytes) -> dict[str, Any]:
    """Negotiation batches may exceed the client message limit; still a versioned map."""
    import msgpack

    message = msgpack.unpackb(body, raw=False, strict_map_key=True)
    if not isinstance(message, dict) or message.get("v") != s.PROTOCOL_VERSION:
        raise s.ProtocolError("control message is not a versioned map")
    return message
