"""Per-job runtime directory, secrets and environment settings.

The daemon, the client library and the CLI all find a job's control socket,
secret and pid file here, so the naming rules live in one module.  Every
environment variable commd reads is parsed and validated here too.
"""

from __future__ import annotations

import hmac
import os
import re
import secrets
import tempfile
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


_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(i?B?)\s*$", re.IGNORECASE)
_SIZE_SHIFT = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}


def parse_bytes(text: str) -> int:
    """A byte count: ``65536``, ``0x10000``, ``64K``, ``1M``, ``64MiB``, ``2GB`` (K/M/G/T are powers of 1024).

    Raises ValueError (callers name the setting).
    """
    match = _SIZE.match(text)
    if match is None or (match.group(3) and not match.group(3).upper().endswith("B")):
        return int(text, 0)  # plain integers in any base, else the ValueError callers report
    number, unit = int(match.group(1)), match.group(2).upper()
    return number << _SIZE_SHIFT[unit]


def env_bytes(name: str, default: int, low: int = 0, high: int = 1 << 62) -> int:
    """A byte count from the environment (see ``parse_bytes``), within [low, high]."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = parse_bytes(raw)
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} is not a byte count (write e.g. 1048576, 1M, 64MiB or 2G)"
        ) from None
    if not low <= value <= high:
        raise ConfigError(f"{name}={raw!r} ({value} bytes) must lie in [{low}, {high}] bytes")
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

    def daemon_pid(self) -> int | None:
        """The pid in the pid file if that process is alive, else None."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        return pid if pid_alive(pid) else None


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
