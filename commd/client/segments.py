"""Registering a segment with the daemon: its memfd passed over the op socket.

A segment is an arena segment or a registered tensor storage (``registry.py``); both
are sealed memfds and travel the same way.

Each registration is one short SEQPACKET connection to the daemon's op
socket: the request (client id, job secret, segment id, name and size) with
the segment's descriptor attached, one reply.  Its own connection, because
the client's op channel may be carrying replies to ops in flight at the
moment an allocation creates a segment.
"""

from __future__ import annotations

import socket
from pathlib import Path

from commd.client.errors import CommdError, ConnectError, from_reply
from commd.client.trust import connect_to_daemon
from commd.memory.arena import ARENA, Segment
from commd.protocol import schema as s
from commd.protocol.fdpass import send_with_fd

REPLY_BYTES = 64 << 10


def register_segment(
    ops_socket: Path, client_id: int, secret: str, segment: Segment, timeout: float, daemon_pid: int
) -> None:
    """Hand ``segment`` to the daemon; raise the daemon's refusal (e.g. a cap) as a CommdError.

    The descriptor and the secret go only to ``daemon_pid`` (the daemon the client
    verified when it connected): the listener's kernel credentials are checked first.
    """
    if segment.fd is None:
        raise CommdError(f"segment {segment.name!r} has no descriptor left to register")
    register_fd(ops_socket, client_id, secret, daemon_pid, timeout,
                segment.seg_id, segment.name, segment.size, segment.fd, segment.kind)
    segment.close_fd()  # the daemon holds its own mapping now


def register_fd(ops_socket: Path, client_id: int, secret: str, daemon_pid: int, timeout: float,
                seg_id: int, name: str, size: int, fd: int, kind: str = ARENA) -> None:
    """Pass one sealed memfd (an arena segment or a registered storage) to the daemon; the caller keeps ``fd``."""
    what = "arena segment" if kind == ARENA else "registered tensor storage"
    request = {"t": s.SEGMENT, "client_id": client_id, "secret": secret,
               "seg": seg_id, "name": name, "size": size}
    if kind != ARENA:
        request["kind"] = kind
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(timeout)
        try:
            connect_to_daemon(sock, ops_socket, daemon_pid, f"to register {what} {name!r}")
            send_with_fd(sock, s.encode(request), fd)
            reply = s.decode(sock.recv(REPLY_BYTES))
        except (OSError, s.ProtocolError) as exc:
            raise ConnectError(f"cannot register {what} {name!r} with the daemon at "
                               f"{ops_socket}: {exc}") from None
    if reply.get("t") != s.ACK:
        raise from_reply(reply.get("code", ""), f"{what} {name!r} ({size} bytes) "
                         f"refused: {reply.get('message', 'no reason given')}")
