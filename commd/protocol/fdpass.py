"""File descriptors beside a SEQPACKET message (SCM_RIGHTS), for arena segments.

A segment travels as its memfd rather than as a name, so the daemon maps
exactly the sealed file the client made (a name could be re-pointed or the
file behind it shrunk).  The receiver closes every descriptor it did not
ask for: a peer must not be able to fill the daemon's descriptor table by
attaching descriptors to its messages.
"""

from __future__ import annotations

import array
import os
import socket

#: At most this many descriptors are accepted with one message (more are closed).
MAX_FDS = 4


def send_with_fd(sock: socket.socket, frame: bytes, fd: int) -> None:
    """Send ``frame`` with ``fd`` attached (the receiver gets its own descriptor)."""
    sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


def recv_with_fds(sock: socket.socket, bufsize: int) -> tuple[bytes, list[int], bool]:
    """One message, the descriptors that came with it, and whether any were cut off (MSG_CTRUNC)."""
    frame, ancdata, flags, _ = sock.recvmsg(bufsize, socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize))
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % array.array("i").itemsize
            fds.extend(array.array("i", data[:usable]))
    return frame, fds, bool(flags & socket.MSG_CTRUNC)


def close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
