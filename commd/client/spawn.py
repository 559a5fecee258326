"""Start the node daemon for a job if none runs yet (first caller wins).

Every local process of a job may call ``ensure_daemon``; a lock file in the
job's private runtime directory makes exactly one of them start it, and the
others wait until its control socket answers.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

import zmq

from commd.client.errors import ConnectError, UntrustedDaemonError
from commd.client.trust import read_job_secret
from commd.protocol import schema as s
from commd.runtime import ConfigError, JobPaths, pid_alive, prune_finished_jobs

SECRET_ENV = "COMMD_SECRET"
#: Between readiness checks of a starting daemon.  A check before the control socket exists
#: is one stat(); 20 ms steps added up to 20 ms to a start that no longer imports torch.
READY_POLL_S = 0.005


def ping(paths: JobPaths, timeout: float = 1.0) -> int | None:
    """The daemon's pid if its control socket answers a ping, else None."""
    if not paths.socket.exists():
        return None
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(paths.endpoint)
        sock.send(s.encode({"t": s.PING}))
        if not sock.poll(int(timeout * 1000)):
            return None
        reply = s.decode(sock.recv())
        return reply.get("pid") if reply.get("t") == s.ACK else None
    except (zmq.ZMQError, s.ProtocolError):
        return None
    finally:
        sock.close()


def start_daemon(
    paths: JobPaths,
    secret: str | None = None,
    exit_when_idle: bool = True,
    extra_args: list[str] | None = None,
    timeout: float = 60.0,
) -> subprocess.Popen:
    """Spawn a daemon process for ``paths.job`` and wait until it answers."""
    env = dict(os.environ)
    if secret is not None:
        env[SECRET_ENV] = secret
    command = [sys.executable, "-m", "commd", "daemon", "--job", paths.job]
    if exit_when_idle:
        command.append("--exit-when-idle")
    command += extra_args or []
    paths.ensure()
    os.utime(paths.directory)  # "in use now": keeps a concurrent start's pruning away from it
    # Finished jobs' directories (their logs) are bounded: every daemon start prunes the old ones.
    prune_finished_jobs(paths.directory.parent, exclude=[paths.job])
    log = open(paths.log_file, "ab")  # the daemon logs to stderr
    proc = subprocess.Popen(
        command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
        start_new_session=True, close_fds=True,
    )
    log.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ConnectError(
                f"commd daemon for job {paths.job!r} exited with code {proc.returncode} while "
                f"starting; see {paths.log_file}:\n{_tail(paths)}"
            )
        if ping(paths, 0.2) == proc.pid:
            return proc
        time.sleep(READY_POLL_S)
    proc.kill()
    raise ConnectError(f"commd daemon for job {paths.job!r} did not answer within {timeout:.0f}s")


def wait_for_secret(paths: JobPaths, timeout: float) -> str:
    """The job's secret, waiting up to ``timeout`` s while a prologue's start of the daemon is in progress.

    A cluster prologue (deploy/slurm/prolog.sh) starts the daemon detached and
    returns at once, so the job's processes may start before the daemon serves
    (a multi-node daemon serves only once every node joined).  A start that
    failed left its reason in the job directory: that reason is the error.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            secret = read_job_secret(paths)  # checks the job's files are ours first
            if secret:  # empty: the daemon is writing it right now
                return secret
        except UntrustedDaemonError:
            raise
        except ConnectError:
            error = paths.start_error()
            if error is not None:
                raise ConnectError(f"the commd daemon of job {paths.job!r} could not be started: {error}") from None
            if not paths.start_in_progress():
                raise
        if time.monotonic() >= deadline:
            raise ConnectError(
                f"the commd daemon of job {paths.job!r} is still starting after {timeout:.0f}s (a multi-node "
                f"daemon serves once every node has joined); last lines of {paths.log_file}:\n{_tail(paths, 5)}"
            )
        time.sleep(0.05)


def _tail(paths: JobPaths, lines: int = 20) -> str:
    try:
        text = paths.log_file.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _answers_before_exit(paths: JobPaths, pid: int, timeout: float) -> bool:
    """True once the job's running daemon ``pid`` answers a ping, False once it has exited.

    A live daemon that does not answer is busy (its first GPU client makes it load torch
    and CUDA, seconds) or finishing its shutdown: wait for one or the other.  Starting a
    second daemon beside a live one only fails (the daemon refuses a job that has one).
    """
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if ping(paths, 0.5) == pid:
            return True
        if time.monotonic() > deadline:
            raise ConnectError(
                f"the commd daemon of job {paths.job!r} (pid {pid}) is running but has not answered for "
                f"{timeout:.0f}s; see {paths.log_file}:\n{_tail(paths, 5)}"
            )
        time.sleep(READY_POLL_S)
    return False


def ensure_daemon(
    paths: JobPaths, secret: str | None = None, timeout: float = 60.0, extra_args: list[str] | None = None
) -> int:
    """Return the pid of the job's daemon, starting one if needed."""
    try:
        paths.ensure()  # refuses a runtime root or job directory that is not ours
    except ConfigError as exc:
        raise ConnectError(f"cannot use the runtime directory of job {paths.job!r}: {exc}") from None
    with open(paths.lock_file, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            pid = paths.daemon_pid()
            if pid is not None and _answers_before_exit(paths, pid, timeout):
                return pid
            return start_daemon(paths, secret, extra_args=extra_args, timeout=timeout).pid
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
