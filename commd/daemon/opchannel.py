"""The op channel: a Unix SEQPACKET socket per client for submissions and replies.

Control traffic (hello, group registration, status, trace, bye, ping) stays on
the ZeroMQ socket.  Ops — the per-step hot path — travel only here, as the same
msgpack messages, and so do segment registrations (each on its own short
connection, the segment's memfd passed beside the message by SCM_RIGHTS).
Why not ZeroMQ for ops: ZeroMQ hands every message to an I/O
thread on each side, which on a node whose cores are shared by the ranks and
the daemon costs about two extra wake-ups per message (measured: the
round trip of a tiny op dropped from ~60 us to ~20 us in a lean prototype).
SEQPACKET keeps message boundaries, and the kernel tells us the peer's uid
(checked) and when a client process dies (its socket closes).

A connection is useless until it sends an ATTACH naming a registered client
id and the job secret.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from commd.protocol import schema as s
from commd.protocol.fdpass import close_all, recv_with_fds
from commd.protocol.seqpacket import peer_closed

log = logging.getLogger("commd.daemon")

SOCKET_BUFFER_BYTES = 4 << 20
#: Replies per batch frame at most: inline results are <= 4 KiB each, so a batch stays far
#: below the message size limit.
REPLY_BATCH = 128


class OpConnection:
    """One client's op channel, with a bounded queue for replies the kernel could not take yet.

    A client that stops reading would otherwise make the daemon hold every
    reply it is sent; past ``max_backlog`` bytes the channel closes and
    ``on_overflow`` tells the daemon, which drops the client.
    """

    def __init__(
        self,
        sock: socket.socket,
        loop: Any,
        max_backlog: int = 1 << 62,
        on_overflow: Callable[[OpConnection], None] | None = None,
    ) -> None:
        self.sock = sock
        self.loop = loop
        self.client: Any = None
        self._backlog: collections.deque[bytes] = collections.deque()
        self.backlog_bytes = 0
        self.max_backlog = max_backlog
        self._on_overflow = on_overflow
        self._replies: list[dict[str, Any]] = []
        self.closed = False
        #: Set when the channel was closed for an overlong backlog: the bytes then queued.
        self.overflowed_at: int | None = None

    def reply(self, message: dict[str, Any]) -> None:
        """Queue an op reply; the replies of one loop turn leave as one frame (see ``_flush_replies``)."""
        if self.closed:
            return
        self._replies.append(message)
        if len(self._replies) == 1:
            self.loop.call_soon(self._flush_replies)

    def _flush_replies(self) -> None:
        """One SEQPACKET frame per loop turn: a burst of completions costs the client one wake-up."""
        replies, self._replies = self._replies, []
        while replies:
            if len(replies) == 1:
                self.send(s.encode(replies[0]))
                return
            batch, replies = replies[:REPLY_BATCH], replies[REPLY_BATCH:]
            self.send(s.encode({"t": s.BATCH, "items": batch}))

    def send(self, frame: bytes) -> None:
        if self.closed:
            return
        if self._replies:  # queued replies go first: the channel stays in order
            self._flush_replies()
        if self._backlog:
            self._queue(frame)
            return
        try:
            self.sock.send(frame)
        except BlockingIOError:
            self._queue(frame)
            if not self.closed:
                self.loop.add_writer(self.sock.fileno(), self._drain)
        except OSError as exc:
            log.debug("op channel send failed: %s", exc)

    def _queue(self, frame: bytes) -> None:
        self._backlog.append(frame)
        self.backlog_bytes += len(frame)
        if self.backlog_bytes > self.max_backlog:
            self._overflow()

    def _overflow(self) -> None:
        """The client stopped reading: free its replies, close the channel, tell the daemon (once)."""
        self.overflowed_at = self.backlog_bytes
        self.close()
        self._backlog.clear()
        self.backlog_bytes = 0
        self._replies.clear()
        if self._on_overflow is not None:
            self.loop.call_soon(self._on_overflow, self)

    def _drain(self) -> None:
        while self._backlog:
            try:
                self.sock.send(self._backlog[0])
            except BlockingIOError:
                return
            except OSError:
                self._backlog.clear()
                self.backlog_bytes = 0
                break
            self.backlog_bytes -= len(self._backlog.popleft())
        self.loop.remove_writer(self.sock.fileno())

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        fd = self.sock.fileno()
        self.loop.remove_reader(fd)
        if self._backlog:
            self.loop.remove_writer(fd)
        self.sock.close()


#: Messages read from one op channel per turn of the event loop (see ``OpListener._readable``).
DRAIN_TURN_MESSAGES = 32
#: At most this many messages read at once when a rank says goodbye (``OpListener.read_queued``):
#: far more than a leaving rank has queued, and a bound on how long it can hold the loop.
LEAVING_READ_MESSAGES = 64 * DRAIN_TURN_MESSAGES


class OpListener:
    """Accepts op-channel connections and feeds their messages to the daemon."""

    def __init__(
        self,
        path: Path,
        loop: Any,
        on_message: Callable[[OpConnection, bytes, list[int]], None],
        on_closed: Callable[[OpConnection], None],
        max_backlog: int = 1 << 62,
        on_overflow: Callable[[OpConnection], None] | None = None,
    ) -> None:
        """``on_overflow``: a channel was closed because its client left over ``max_backlog`` bytes unread."""
        self.path = path
        self.loop = loop
        self.on_message = on_message
        self.on_closed = on_closed
        self.max_backlog = max_backlog
        self.on_overflow = on_overflow
        self.connections: set[OpConnection] = set()
        if path.exists():
            path.unlink()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old_umask = os.umask(0o177)
        try:
            self.sock.bind(str(path))
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        self.sock.listen(256)
        self.sock.setblocking(False)
        loop.add_reader(self.sock.fileno(), self._accept)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                log.warning("op channel accept failed: %s", exc)
                return
            uid = _peer_uid(conn)
            if uid != os.getuid():
                log.warning("refusing an op channel from uid %s", uid)
                conn.close()
                continue
            conn.setblocking(False)
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                conn.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
            channel = OpConnection(conn, self.loop, self.max_backlog, self._overflowed)
            self.connections.add(channel)
            self.loop.add_reader(conn.fileno(), self._readable, channel)

    def _readable(self, channel: OpConnection) -> None:
        """At most ``DRAIN_TURN_MESSAGES`` per call: the reader is level-triggered, so the loop
        calls back for the rest after its timers (the watchdog) and the other channels had
        their turn; a rank that submits as fast as it is answered cannot starve them."""
        self._read(channel, DRAIN_TURN_MESSAGES)

    def read_queued(self, channel: OpConnection) -> None:
        """Handle the messages already queued on ``channel`` now, ahead of the channel's turn.

        For a rank that says goodbye on the control socket (``ControlIngress``): the two sockets
        keep no order between them, so what the rank sent here before its BYE (its exchange
        ring's last traced ops, ops) may still be unread when the BYE is handled; closing the
        channel then would drop it unread.  Bounded by ``LEAVING_READ_MESSAGES``."""
        if self._read(channel, LEAVING_READ_MESSAGES) == LEAVING_READ_MESSAGES:
            log.warning("op channel: a leaving client had %d messages or more queued; any after them are dropped",
                        LEAVING_READ_MESSAGES)

    def _read(self, channel: OpConnection, limit: int) -> int:
        """Read and handle up to ``limit`` messages, with any descriptors passed beside them (a
        segment's memfd); those are lent to ``on_message`` and always closed here afterwards (it
        maps, it keeps none).  Returns how many were read; fewer than ``limit``: none is left."""
        for count in range(limit):
            if channel.closed:
                return count
            fds: list[int] = []
            try:
                frame, fds, truncated = recv_with_fds(channel.sock, s.MAX_MESSAGE_BYTES + 1)
            except BlockingIOError:
                return count
            except OSError:
                frame = None
            try:
                if frame == b"" and not peer_closed(channel.sock):
                    self.on_message(channel, frame, fds)  # an empty datagram: a bad message, answered as such
                    continue
                if not frame:
                    self.connections.discard(channel)
                    channel.close()
                    self.on_closed(channel)
                    return count
                if truncated:
                    log.warning("op channel: a message came with more descriptors than allowed; dropped")
                    channel.send(s.encode({"t": s.ERROR, "code": s.E_PROTOCOL, "id": -1,
                                           "message": "too many file descriptors with one message"}))
                    continue
                self.on_message(channel, frame, fds)
            finally:
                close_all(fds)
        return limit

    def _overflowed(self, channel: OpConnection) -> None:
        self.connections.discard(channel)
        if self.on_overflow is not None:
            self.on_overflow(channel)

    def close(self) -> None:
        for channel in list(self.connections):
            channel.close()
        self.connections.clear()
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]
