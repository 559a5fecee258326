"""Ask a job's daemon over its control socket: the status map, trace on/off.

The control socket (ZeroMQ ROUTER) answers one request per connection here:
every request carries the job secret, read from the private job directory
only after the directory, the secret file and the socket proved to be ours,
so only the job's owner can ask.  ``commd status``, ``commd trace``, the
benchmark's workers and the tests use these, which is why they live on the
client side and not in the command line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import zmq

from commd.protocol import schema as s
from commd.runtime import JOB_NAME, ConfigError, JobPaths, check_own_socket, runtime_root

DEFAULT_TIMEOUT_S = 5.0
#: Starting a trace opens a file on every node of a fabric: allowed longer than a status query.
TRACE_TIMEOUT_S = 10.0


class StatusError(Exception):
    """The daemon cannot be asked: no daemon, several to choose from, no answer, a refusal."""


def live_jobs(root: Path | None = None) -> list[tuple[str, int]]:
    """(job, daemon pid) for every job directory under the runtime root with a live daemon."""
    root = root if root is not None else runtime_root()
    try:
        entries = sorted(root.iterdir())
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    found = []
    for entry in entries:
        if not entry.is_dir() or not JOB_NAME.match(entry.name):
            continue
        pid = JobPaths(entry.name, entry).daemon_pid()
        if pid is not None:
            found.append((entry.name, pid))
    return found


def resolve_job(job: str | None, env_job: str | None) -> JobPaths:
    """The job to ask: --job, else $COMMD_JOB, else the only job with a live daemon."""
    name = job or env_job
    if name:
        return JobPaths.for_job(name)
    root = runtime_root()
    jobs = live_jobs(root)
    if not jobs:
        raise StatusError(f"no running commd daemon found under {root}; start a job with "
                          "`commd launch`, or name one with --job (set COMMD_RUNTIME_DIR if it "
                          "uses another runtime directory)")
    if len(jobs) > 1:
        listing = "\n".join(f"  {name}  (daemon pid {pid})" for name, pid in jobs)
        raise StatusError(f"several jobs have a running daemon under {root}; choose one with --job:\n{listing}")
    return JobPaths.for_job(jobs[0][0])


def control_request(paths: JobPaths, message: dict[str, Any], timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """Send one control message (the job secret added) to the job's daemon; its reply.

    The secret goes out only after the job directory, the secret file and the socket
    proved to be ours (``JobPaths.read_secret``, ``check_own_socket``).  Raises
    StatusError with a readable reason, also when the daemon refuses.
    """
    if not paths.socket.exists():
        raise StatusError(f"no daemon for job {paths.job!r}: {paths.socket} does not exist")
    try:
        secret = paths.read_secret()  # checks the job directory is ours and private first
        check_own_socket(paths.socket)  # the secret goes only to a socket of ours
    except ConfigError as exc:
        raise StatusError(str(exc)) from None
    except PermissionError:
        raise StatusError(f"cannot read {paths.secret_file}: the job belongs to another user") from None
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(paths.endpoint)
        sock.send(s.encode({**message, "secret": secret}))
        if not sock.poll(int(timeout * 1000)):
            pid = paths.daemon_pid()
            why = f"pid {pid} is alive but busy or stuck" if pid else "it is not running"
            raise StatusError(f"the daemon of job {paths.job!r} did not answer within {timeout:g}s ({why})")
        reply = s.decode(sock.recv())
    except (zmq.ZMQError, s.ProtocolError) as exc:
        raise StatusError(f"cannot talk to the daemon of job {paths.job!r}: {exc}") from None
    finally:
        sock.close()
    if reply.get("t") == s.ERROR:
        raise StatusError(f"the daemon of job {paths.job!r} refused: {reply.get('message')}")
    return reply


def query_status(paths: JobPaths, timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """Ask the job's daemon for its status map (raises StatusError with a readable reason)."""
    reply = control_request(paths, {"t": s.STATUS}, timeout)
    status = reply.get("status")
    if reply.get("t") != s.STATUS or not isinstance(status, dict):
        raise StatusError(f"unexpected reply from the daemon of job {paths.job!r}: {reply.get('t')!r}")
    return status


def send_trace_control(paths: JobPaths, action: str, path: str | None,
                       timeout: float = TRACE_TIMEOUT_S) -> dict[str, Any]:
    """Ask the job's daemon to start (``path``) or stop tracing; its answer (raises StatusError)."""
    reply = control_request(paths, {"t": s.TRACE, "action": action, "path": path}, timeout)
    if reply.get("t") != s.ACK:
        raise StatusError(f"unexpected reply from the daemon of job {paths.job!r}: {reply.get('t')!r}")
    return reply
