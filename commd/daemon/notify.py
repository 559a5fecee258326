"""systemd readiness notification (sd_notify) without libsystemd.

With ``Type=notify`` systemd considers the daemon started only when it says
``READY=1`` on ``$NOTIFY_SOCKET``: so ``systemctl start commd@job`` returns
once workers can connect, and a daemon that fails while forming its fabric
fails the start.  The protocol is one datagram on a Unix socket (a path, or
an abstract name written with a leading '@').  Outside systemd the variable
is unset and every call does nothing.
"""

from __future__ import annotations

import logging
import os
import socket

NOTIFY_ENV = "NOTIFY_SOCKET"

log = logging.getLogger("commd.daemon")


def notify(state: str) -> bool:
    """Send ``state`` (e.g. ``READY=1``) to the service manager; False when there is none or it failed.

    A failure is logged, never raised: readiness is a courtesy to the manager,
    the daemon serves its clients either way.
    """
    address = os.environ.get(NOTIFY_ENV)
    if not address:
        return False
    if address.startswith("@"):
        target = "\0" + address[1:]
    elif address.startswith("/"):
        target = address
    else:
        log.warning("ignoring %s=%r: neither an absolute path nor an abstract name (@...)", NOTIFY_ENV, address)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(target)
            sock.sendall(state.encode())
    except OSError as exc:
        log.warning("cannot notify the service manager at %s (%s): %s", address, state, exc)
        return False
    return True


def ready(job: str) -> bool:
    """The daemon accepts clients."""
    return notify(f"READY=1\nSTATUS=serving job {job}")


def stopping(reason: str) -> bool:
    """The daemon began its shutdown."""
    return notify(f"STOPPING=1\nSTATUS=stopping: {reason}"[:4000])
