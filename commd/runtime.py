"""Per-job runtime directory, secrets and environment settings.

The daemon, the client library and the CLI all find a job's control socket,
secret and pid file here, so the naming rules live in one module.  Every
environment variable commd reads is parsed and validated here too.
"""

from __future__ import annotations

import fcntl
import hmac
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

JOB_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
DEFAULT_JOB = "default"
SOCKET_NAME = "control.sock"
OPS_SOCKET_NAME = "ops.sock"
SECRET_NAME = "secret"
PID_NAME = "daemon.pid"
LOG_NAME = "daemon.log"
LOCK_NAME = "start.lock"
#: Written by a cluster prologue that started the daemon detached: the pid of the process
#: supervising the start (removed when the daemon exits); clients wait while it lives.
STARTING_NAME = "starting"
#: Written by a cluster prologue when the daemon could not be started, or exited with an error:
#: the reason, which clients report instead of "no daemon".
START_ERROR_NAME = "start.error"
#: Where deploy/prologue.sh sends a detached daemon's output.
DAEMON_OUT_NAME = "daemon.out"
#: Everything commd puts in a job directory; a directory holding anything else is never pruned.
JOB_FILES = frozenset({
    SOCKET_NAME, OPS_SOCKET_NAME, SECRET_NAME, PID_NAME, LOG_NAME, LOCK_NAME,
    STARTING_NAME, START_ERROR_NAME, DAEMON_OUT_NAME,
})
#: Finished jobs whose directories (and so their daemon.log) are kept: the most recent ones ...
KEEP_FINISHED_JOBS = 10
#: ... and none older than this.
KEEP_FINISHED_S = 7 * 24 * 3600.0
#: A directory touched this recently may belong to a job starting right now: never pruned.
PRUNE_GRACE_S = 60.0


class ConfigError(ValueError):
    """A setting from the environment, a flag or a file is invalid."""


def env_float(name: str, default: float, low: float = 0.0, high: float = 1e9) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if not low <= value <= high:
        raise ConfigError(f"{name}={raw!r} must lie in [{low}, {high}]")
    return value


def env_int(name: str, default: int, low: int = 0, high: int = 1 << 62) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw, 0)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if not low <= value <= high:
        raise ConfigError(f"{name}={raw!r} must lie in [{low}, {high}]")
    return value


def check_job(job: str) -> str:
    if not JOB_NAME.match(job):
        raise ConfigError(
            f"job name {job!r} is invalid: use 1-64 letters, digits, '_', '.', '-'"
        )
    return job


def runtime_root() -> Path:
    """$COMMD_RUNTIME_DIR, else $XDG_RUNTIME_DIR/commd, else /tmp/commd-<uid>."""
    explicit = os.environ.get("COMMD_RUNTIME_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "commd"
    return Path(tempfile.gettempdir()) / f"commd-{os.getuid()}"


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise ConfigError(f"runtime directory {path} belongs to uid {st.st_uid}, not to us")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


@dataclass(frozen=True)
class JobPaths:
    """Where one job's daemon keeps its socket, secret, pid and log."""

    job: str
    directory: Path

    @classmethod
    def for_job(cls, job: str | None = None) -> JobPaths:
        name = check_job(job or os.environ.get("COMMD_JOB") or DEFAULT_JOB)
        return cls(name, runtime_root() / name)

    def ensure(self) -> JobPaths:
        _private_dir(self.directory.parent)
        _private_dir(self.directory)
        return self

    @property
    def socket(self) -> Path:
        return self.directory / SOCKET_NAME

    @property
    def ops_socket(self) -> Path:
        return self.directory / OPS_SOCKET_NAME

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.socket}"

    @property
    def secret_file(self) -> Path:
        return self.directory / SECRET_NAME

    @property
    def pid_file(self) -> Path:
        return self.directory / PID_NAME

    @property
    def log_file(self) -> Path:
        return self.directory / LOG_NAME

    @property
    def lock_file(self) -> Path:
        return self.directory / LOCK_NAME

    @property
    def starting_file(self) -> Path:
        return self.directory / STARTING_NAME

    @property
    def start_error_file(self) -> Path:
        return self.directory / START_ERROR_NAME

    def start_error(self) -> str | None:
        """Why a prologue's start of the daemon failed, or None (first 4 KiB of the file)."""
        try:
            with open(self.start_error_file, errors="replace") as f:
                text = f.read(4096).strip()
        except OSError:
            return None
        return text or "(no reason recorded)"

    def start_in_progress(self) -> bool:
        """A prologue's start of the daemon has neither finished nor failed (its supervisor still runs)."""
        try:
            pid = int(self.starting_file.read_text().strip())
        except (OSError, ValueError):
            return False
        return pid > 0 and pid_alive(pid)

    def read_secret(self) -> str:
        try:
            return self.secret_file.read_text().strip()
        except FileNotFoundError:
            raise ConfigError(
                f"no secret for job {self.job!r} at {self.secret_file}: is its daemon running?"
            ) from None

    def write_secret(self, secret: str) -> None:
        fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        with os.fdopen(fd, "w") as f:
            f.write(secret)

    def clear_keeping_log(self) -> None:
        """Remove everything in the job directory but its log (a finished job's post-mortem)."""
        try:
            entries = list(self.directory.iterdir())
        except FileNotFoundError:
            return
        for entry in entries:
            if entry.name == LOG_NAME:
                continue
            try:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink()
            except FileNotFoundError:
                pass
        if not self.log_file.exists():
            try:
                self.directory.rmdir()
            except OSError:
                pass

    def daemon_pid(self) -> int | None:
        """The pid in the pid file if that process is alive, else None."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        return pid if pid_alive(pid) else None


def prune_finished_jobs(
    root: Path | None = None,
    keep: int = KEEP_FINISHED_JOBS,
    max_age_s: float = KEEP_FINISHED_S,
    exclude: Iterable[str] = (),
    now: float | None = None,
) -> list[Path]:
    """Remove the directories of finished jobs beyond the ``keep`` most recent and older than
    ``max_age_s``; returns what was removed.

    Every daemon start calls this, so finished jobs' directories (each holding its daemon.log
    once the daemon has exited) stay bounded instead of piling up one per run.  A directory is
    *finished* when no live daemon owns it (no pid file, or its pid is gone), it was not touched
    for ``PRUNE_GRACE_S`` (a job may be starting in it), it belongs to us and holds nothing but
    commd's own files.  Recency is the newest modification time of the directory and its log.
    """
    root = root if root is not None else runtime_root()
    now = time.time() if now is None else now
    skip = set(exclude)
    finished: list[tuple[float, Path]] = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    for entry in entries:
        if entry.name in skip or not JOB_NAME.match(entry.name) or entry.is_symlink() or not entry.is_dir():
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            names = {child.name for child in entry.iterdir()}
            paths = JobPaths(entry.name, entry)
            if not names <= JOB_FILES or paths.daemon_pid() is not None or paths.start_in_progress():
                continue
            stamps = [entry.stat().st_mtime] + [(entry / n).stat().st_mtime for n in names & {LOG_NAME, PID_NAME}]
        except OSError:
            continue
        last = max(stamps)
        if now - last >= PRUNE_GRACE_S and not _locked(entry / LOCK_NAME):
            finished.append((last, entry))
    finished.sort(reverse=True)
    removed = []
    for index, (last, entry) in enumerate(finished):
        if index >= keep or now - last > max_age_s:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _locked(lock_file: Path) -> bool:
    """True if someone holds the job's start lock (a daemon is being started there now)."""
    try:
        fd = os.open(lock_file, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing releases a lock we took
    return False


def new_secret() -> str:
    return secrets.token_hex(32)


def secrets_equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie (a dead child not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (FileNotFoundError, IndexError):
        return False
