"""Whom a client trusts: the job's files and the daemon process behind its sockets.

A client hands its daemon tensors and the job secret and believes the results
it gets back, so before it sends anything it makes sure the daemon is one of
the user's own processes:

1. The runtime root, the job directory, ``control.sock``, ``ops.sock`` and the
   ``secret`` file must belong to our uid and be closed to everyone else
   (``JobPaths.verify`` and ``runtime.check_own_socket``): another local user
   cannot plant a job directory or a socket where we look.
2. The op channel (Unix SEQPACKET) is connected first, and the kernel's
   SO_PEERCRED on it must name our uid — and the pid in ``daemon.pid`` when
   there is one.  The credentials are those of the process that called
   ``listen()``, so this identifies the daemon itself, not the file.
3. Only then does the hello with the job secret go out on ``control.sock``.
   That socket is ZeroMQ ipc, whose peer credentials ZeroMQ does not expose;
   it is trusted because its file is ours and 0600 inside our 0700 directory
   (only our uid or root could have bound it), the op channel of the same job
   directory has just proved to be our daemon, and the welcome must name that
   same daemon pid.  The daemon in turn checks our uid on the op channel and
   the job secret in the hello.

What this cannot stop: root on the node, and anything running as our own uid.
"""

from __future__ import annotations

import os
import socket
import struct
import time

from commd.client.errors import ConnectError, UntrustedDaemonError
from commd.runtime import ConfigError, JobPaths, UntrustedPathError, check_own_socket, pid_alive

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
SOCKET_APPEAR_POLL_S = 0.01


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


def verify_job_files(paths: JobPaths) -> None:
    """Directories and both sockets of the job are ours and private (raises UntrustedDaemonError)."""
    try:
        paths.verify()
        check_own_socket(paths.socket)
    except UntrustedPathError as exc:
        raise UntrustedDaemonError(f"refusing job {paths.job!r}: {exc}") from None
    except ConfigError as exc:
        raise ConnectError(f"no commd daemon for job {paths.job!r}: {exc}") from None


def read_job_secret(paths: JobPaths) -> str:
    """The job secret from the verified job directory (a clear ConnectError if it cannot be had)."""
    try:
        return paths.read_secret()
    except UntrustedPathError as exc:
        raise UntrustedDaemonError(f"refusing job {paths.job!r}: {exc}") from None
    except ConfigError as exc:
        raise ConnectError(str(exc)) from None


def connect_to_daemon(sock: socket.socket, ops_socket: object, daemon_pid: int, what: str) -> None:
    """Connect ``sock`` to ``ops_socket`` and refuse to go on unless ``daemon_pid`` listens there.

    For the short connections that carry a descriptor or the job secret (a segment, a
    ring): they go only to the daemon the client verified when it connected.
    """
    sock.connect(str(ops_socket))
    peer_pid = peer_credentials(sock)[0]
    if peer_pid != daemon_pid:
        raise UntrustedDaemonError(
            f"refusing {what}: pid {peer_pid} listens on {ops_socket}, not the daemon (pid {daemon_pid})"
        )


def connect_op_channel(sock: socket.socket, paths: JobPaths, deadline: float) -> int:
    """Connect ``sock`` to the job's ``ops.sock`` and prove the listener is our daemon; its pid.

    The daemon binds ``ops.sock`` just after ``control.sock`` and listens a moment
    later, so a missing or refusing socket is retried until ``deadline`` — unless
    the daemon recorded in ``daemon.pid`` is dead (a stale socket: fail at once).
    """
    while True:
        try:
            if os.path.lexists(paths.ops_socket):
                check_own_socket(paths.ops_socket)
                sock.connect(str(paths.ops_socket))
                break
            why = f"{paths.ops_socket} does not exist"
        except UntrustedPathError as exc:
            raise UntrustedDaemonError(f"refusing job {paths.job!r}: {exc}") from None
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            why = f"{paths.ops_socket}: {exc.strerror}"
        except (ConfigError, OSError) as exc:
            raise ConnectError(f"cannot open the op channel {paths.ops_socket}: {exc}") from None
        recorded = _recorded_pid(paths)
        if time.monotonic() > deadline or (recorded is not None and not pid_alive(recorded)):
            raise ConnectError(f"no commd daemon answers for job {paths.job!r}: {why}")
        time.sleep(SOCKET_APPEAR_POLL_S)
    return verify_daemon_peer(sock, paths)


def verify_daemon_peer(sock: socket.socket, paths: JobPaths) -> int:
    """The process listening on the connected op channel is ours (and the job's daemon); its pid."""
    pid, uid, _ = peer_credentials(sock)
    if uid != os.getuid():
        raise UntrustedDaemonError(
            f"refusing job {paths.job!r}: the process behind {paths.ops_socket} (pid {pid}) runs as "
            f"uid {uid}, not as us (uid {os.getuid()})"
        )
    recorded = _recorded_pid(paths)
    if pid and recorded is not None and recorded != pid:  # pid 0: the daemon is in another pid namespace
        raise UntrustedDaemonError(
            f"refusing job {paths.job!r}: the process behind {paths.ops_socket} is pid {pid}, but "
            f"{paths.pid_file} names pid {recorded} as the job's daemon"
        )
    return pid


def _recorded_pid(paths: JobPaths) -> int | None:
    try:
        return int(paths.pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
