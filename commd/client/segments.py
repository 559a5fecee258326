"""Registering an arena segment with the daemon: its memfd passed over the op socket.

Each registration is one short SEQPACKET connection to the daemon's op
socket: the request (client id, job secret, segment id, name and size) with
the segment's descriptor attached, one reply.  Its own connection, because
the client's op channel may be carrying replies to ops in flight at the
moment an allocation creates a segment.
"""

from __future__ import annotations

import socket
from pathlib import Path

from commd.client.errors import CommdError, ConnectError, UntrustedDaemonError, from_reply
from commd.client.trust import peer_credentials
from commd.memory.arena import Segment
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
    request = {"t": s.SEGMENT, "client_id": client_id, "secret": secret,
               "seg": segment.seg_id, "name": segment.name, "size": segment.size}
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(str(ops_socket))
            peer_pid = peer_credentials(sock)[0]
            if peer_pid != daemon_pid:
                raise UntrustedDaemonError(
                    f"refusing to register arena segment {segment.name!r}: pid {peer_pid} listens on "
                    f"{ops_socket}, not the daemon (pid {daemon_pid})"
                )
            send_with_fd(sock, s.encode(request), segment.fd)
            reply = s.decode(sock.recv(REPLY_BYTES))
        except (OSError, s.ProtocolError) as exc:
            raise ConnectError(f"cannot register arena segment {segment.name!r} with the daemon at "
                               f"{ops_socket}: {exc}") from None
    if reply.get("t") != s.ACK:
        raise from_reply(reply.get("code", ""), f"arena segment {segment.name!r} ({segment.size} bytes) "
                         f"refused: {reply.get('message', 'no reason given')}")
    segment.close_fd()  # the daemon holds its own mapping now
