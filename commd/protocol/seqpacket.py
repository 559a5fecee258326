"""Telling a closed SEQPACKET peer from an empty datagram.

On a Unix SEQPACKET socket ``recv`` returns ``b""`` both at end of file (the
peer closed) and for a zero-length datagram, which any peer may send.  Taking
the latter for a disconnect let one empty message cut a client off.  The
kernel marks a socket whose peer is gone with POLLHUP/POLLRDHUP, so after an
empty read a zero-timeout poll settles it.
"""

from __future__ import annotations

import select
import socket

_HANGUP = select.POLLHUP | select.POLLRDHUP | select.POLLERR


def peer_closed(sock: socket.socket) -> bool:
    """After ``recv`` returned ``b""``: True if the peer closed the connection, False if it
    sent an empty datagram (a protocol error, not a disconnect)."""
    try:
        fd = sock.fileno()
    except OSError:
        return True
    if fd < 0:
        return True
    poller = select.poll()
    poller.register(fd, _HANGUP)
    return any(events & _HANGUP for _, events in poller.poll(0))
