"""Per-job runtime directory, secrets and environment settings.

The daemon, the client library and the CLI all find a job's control socket,
secret and pid file here, so the naming rules live in one module.  Every
environment variable commd reads is parsed and validated here too, and the
small process-level helpers the command line and the tests share live here
(``free_port``).
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import hashlib
import hmac
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

JOB_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
DEFAULT_JOB = "default"
SOCKET_NAME = "control.sock"
OPS_SOCKET_NAME = "ops.sock"
#: The longest path a Unix socket can bind or connect to on Linux (``sun_path`` holds 108 bytes with the NUL).
MAX_SOCKET_PATH = 107
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
SECRET_ENV = "COMMD_SECRET"
SECRET_FILE_ENV = "COMMD_SECRET_FILE"
#: A job secret given by the user must be at least this long (a shorter one is guessable).
MIN_SECRET_CHARS = 16
MAX_SECRET_BYTES = 4096

#: Every environment variable commd reads, with what it sets (one line each): the reference of
#: the documentation is generated from it, and a test checks that every COMMD_* name the source
#: mentions is here.  Where a variable and a flag set the same thing, the flag wins.
ENVIRONMENT: dict[str, str] = {
    "COMMD_ALGORITHMS_DIR": "Directory of collective programs (MSCCL XML files, checked at load) this node's daemon "
                            "can run, and that `commd algo list` lists (the daemon's `--algorithms-dir`; else the "
                            "config's `[scheduler] algorithms_dir`).",
    "COMMD_ARENA_BYTES": "A client's arena size at start, a byte count such as `64M` (default: 64 MiB or an "
                         "eighth of the free shared memory, whichever is less; the arena grows on demand).",
    "COMMD_CHAOS_DELAY_MS": "Testing: before 30% of the lane ops, the daemon sleeps a random time up to this many "
                            "milliseconds (default 0: never; the deadlock stress test sets it).",
    "COMMD_CHAOS_SEED": "Testing: the seed of those random delays (default 0).",
    "COMMD_COMPRESSION": "The torch backend's codec between nodes for groups whose options name none: a codec "
                         "name, `auto` (the daemons may choose a lossy one) or `none` (default: the daemons may "
                         "choose a lossless one).",
    "COMMD_CONFIG": "The daemon's TOML config file (`commd daemon --config`).",
    "COMMD_CONTROL_FANOUT": "Node 0 only: children per daemon in the control tree that carries reports and "
                            "releases (default 8; a fabric of at most this many + 1 nodes is a star; wins over "
                            "`[scheduler] control_fanout`).",
    "COMMD_CUDA_IPC": "`0`: a client stages CUDA tensors through host memory even when its daemon has a GPU "
                      "(default `1`: CUDA IPC references).",
    "COMMD_FUSION_CYCLE_MS": "How long a daemon collects ready ops before reporting them to the coordinator "
                             "(`--fusion-cycle-ms`; default 0: once per event-loop turn).",
    "COMMD_FUSION_THRESHOLD": "Small all-reduces released together are fused up to this many bytes "
                              "(`--fusion-threshold`; default 65536, 0 disables).",
    "COMMD_GC_FREEZE": "`0`: the daemon does not freeze its heap out of the garbage collector's reach once set "
                       "up (default `1`).",
    "COMMD_JOB": "The job name: which daemon a client, `commd status` or `commd trace` talks to, and the "
                 "daemon's `--job` (default `default`; `commd launch` exports it to its workers).",
    "COMMD_KERNEL_THREADS": "The daemon's torch intra-op threads (default 1).",
    "COMMD_KERNEL_WORKERS": "Daemon threads that share the blocks of a large single-node reduction (default: the "
                            "core count, at most 4).",
    "COMMD_LOCAL_RING": "`0`: a client never uses exchange rings, every op takes the daemon path (default `1`).",
    "COMMD_RING_BRIDGE": "Who bridges the exchange ring of a torch group that spans nodes: `daemon` (default: the "
                         "node daemon, over the fabric's control links; all-reduces up to 64 KiB) or `rank` (the "
                         "node's first rank of the group, on a thread, connected directly to the other nodes' first "
                         "ranks; all-reduces up to 512 KiB). Every rank must agree.",
    "COMMD_LOG_LEVEL": "The daemon's log level (`--log-level`; default `INFO`).",
    "COMMD_MAX_ARENA_BYTES": "Bytes of arena segments one client may register with the daemon (default: the "
                             "machine's physical memory).",
    "COMMD_MAX_OP_TIMEOUT": "The longest op timeout a client may ask for; longer ones are capped "
                            "(`--max-op-timeout`; default 24 h, or `--op-timeout` if longer).",
    "COMMD_MAX_PENDING_BYTES": "Inline tensor bytes the daemon holds for one client's pending ops "
                               "(`--max-pending-bytes`; default 64 MiB).",
    "COMMD_MAX_PENDING_OPS": "Ops one client may have submitted and not yet answered (`--max-pending-ops`; "
                             "default 65536).",
    "COMMD_MAX_REGISTERED_BYTES": "Bytes of registered tensor storages one client may have mapped in the daemon, "
                                  "read by both (default: half the machine's physical memory; 0 turns "
                                  "registration off).",
    "COMMD_MAX_REPLY_BACKLOG": "Reply bytes queued for a client that does not read its op channel; past it the "
                               "client is dropped (`--max-reply-backlog`; default 128 MiB).",
    "COMMD_MAX_SEGMENTS": "Shared-memory segments (arena and registered) one client may register with the daemon "
                          "(default 1024).",
    "COMMD_METRICS_ADDR": "The address the daemon's metrics endpoint binds to (`--metrics-addr`; default "
                          "127.0.0.1).",
    "COMMD_METRICS_INTERVAL": "Seconds between rewrites of the metrics textfile (`--metrics-interval`; "
                              "default 15).",
    "COMMD_METRICS_PORT": "Serve Prometheus metrics on this port, 0: any free port (`--metrics-port`; default: "
                          "no endpoint).",
    "COMMD_METRICS_TEXTFILE": "Also write the metrics to this file, for node_exporter's textfile collector "
                              "(`--metrics-textfile`).",
    "COMMD_NNODES": "The number of nodes (daemons) in the job (`commd daemon --nnodes`; default 1).",
    "COMMD_NODE": "This node's name, unique per node (default: the hostname); read by the daemon, the torch "
                  "backend, `commd launch` and the benchmark.",
    "COMMD_NODE_RANK": "This node's rank in the fabric (`commd daemon --node-rank`).",
    "COMMD_OP_TIMEOUT": "Seconds an op may wait for its peers: a client's timeout when neither the op nor its "
                        "process group gives one, and the daemon's `--op-timeout` (default 30).",
    "COMMD_PEER_TIMEOUT": "Seconds of silence before a peer daemon counts as dead (`--peer-timeout`; "
                          "default 10).",
    "COMMD_SCHEDULE": "`0`: node 0's coordinator never publishes a schedule, so every op across nodes is "
                      "negotiated through it (default `1`: a group's ops that repeat a cycle run without it).",
    "COMMD_RECORD": "A directory: every rank of the torch backend writes the ops it submits there as a PARAM "
                    "comms trace, `rank<R>.json` (`commd launch --record`; replay with `commd replay`).",
    "COMMD_RESTART_COUNT": "How often `commd launch --max-restarts` started this rank before (set for the "
                           "workers; `0` for a first start): commd.ft's guard of a restarted rank waits for the "
                           "running ranks to take it back in.",
    "COMMD_REGISTER": "`0`: a client never registers tensor storages, it stages them (default `1`).",
    "COMMD_REGISTER_FIRST_BYTES": "An in-place op's tensor of at least this many bytes has its storage registered "
                                  "at its first sighting (default 64 MiB).",
    "COMMD_RENDEZVOUS": "HOST:PORT of the TCPStore the daemons rendezvous on (`commd daemon --rendezvous`).",
    "COMMD_RENDEZVOUS_TIMEOUT": "Seconds a daemon waits for every node at the rendezvous "
                                "(`--rendezvous-timeout`; default 300).",
    "COMMD_RUNTIME_DIR": "The root of the per-job runtime directories (default: `$XDG_RUNTIME_DIR/commd`, else "
                         "`/tmp/commd-<uid>`).",
    "COMMD_SECRET": "The job secret (at least 16 characters); a job on several nodes needs the same one on "
                    "every node.",
    "COMMD_SECRET_FILE": "A file holding the job secret, readable by its owner only (mode 0600); read when "
                         "COMMD_SECRET is unset.",
    "COMMD_TORCH_WARMUP": "`0`: the daemon imports torch only when an op needs it, not in the background after "
                          "start (default `1`).",
    "COMMD_TRACE": "The daemon traces every op's phases into this file from the start (`--trace`).",
    "COMMD_TUNING": "The tuning table node 0's daemon loads: a path or `off` (`--tuning`; default: the "
                    "config's `[scheduler] tuning`, else the default table of the tuning directory).",
    "COMMD_TUNING_DIR": "Where tuning tables are saved and looked for (default: "
                        "`$XDG_CACHE_HOME/commd/tuning`, else `~/.cache/commd/tuning`).",
}


class ClosedAtExit:
    """Objects whose ``close()`` must run at interpreter exit, before module teardown and before Python
    stops daemon threads: a torch group destroyed during finalisation, or a thread stopped inside
    torch's C++, aborts the process ("terminate called without an active exception").  Held weakly.
    Registered with ``atexit`` when made, so make one at a module's import: exit hooks run in the
    reverse order of registration, and this keeps each module's place in that order."""

    def __init__(self) -> None:
        self._open: weakref.WeakSet[Any] = weakref.WeakSet()
        atexit.register(self.close_all)

    def add(self, obj: Any) -> None:
        self._open.add(obj)

    def discard(self, obj: Any) -> None:
        self._open.discard(obj)

    def close_all(self) -> None:
        for obj in list(self._open):
            obj.close()


class ConfigError(ValueError):
    """A setting from the environment, a flag or a file is invalid.

    Raised in the process that reads the setting (a rank's client for its COMMD_* variables, the daemon at
    start for its flags, variables and config file), the message naming the setting and what is wrong."""


class UntrustedPathError(ConfigError):
    """A runtime directory, socket or secret file could have been planted by someone else.

    Raised before anything is read from or sent to it: the text names the path
    and what is wrong (owner uid, mode, file type).
    """


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


def _describe(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)} ({stat.S_IMODE(st.st_mode):04o})"


def check_trusted_ancestry(path: Path) -> None:
    """Refuse ``path`` if anyone but us (or root) could replace it or anything above it.

    Every directory from ``/`` down to ``path`` must belong to root or to us,
    and one writable by group or others must be sticky (like /tmp), so nobody
    else can rename our entries away and put their own in their place — the
    rule ssh's StrictModes applies to a home directory.
    """
    uid = os.getuid()
    given = Path(os.path.abspath(path))
    for component in [*reversed(given.parents), given]:
        # A symlink on the way is as good as its owner: one of someone else's (say, planted in
        # /tmp) could be re-pointed at any time.
        try:
            st = os.lstat(component)
        except FileNotFoundError:
            break
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, uid):
            raise UntrustedPathError(
                f"{component} is a symlink of uid {st.st_uid}, neither ours (uid {uid}) nor root's: "
                f"it could re-point commd's runtime directory {path} anywhere"
            )
    resolved = Path(os.path.realpath(path))
    for component in [*reversed(resolved.parents), resolved]:
        try:
            st = os.stat(component)
        except FileNotFoundError:
            return  # not created yet: whoever creates it below us checks it then
        if not stat.S_ISDIR(st.st_mode):
            raise UntrustedPathError(f"{component} is not a directory ({_describe(st)})")
        if st.st_uid not in (0, uid):
            raise UntrustedPathError(
                f"{component} belongs to uid {st.st_uid}, neither to us (uid {uid}) nor to root: "
                f"it could replace commd's runtime directory {path} ({_describe(st)})"
            )
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise UntrustedPathError(
                f"{component} is writable by group or others and not sticky: anyone could replace "
                f"commd's runtime directory {path} ({_describe(st)})"
            )


def check_runtime_root(root: Path) -> None:
    """The runtime root is ours and private, or a shared root-owned sticky directory (like /tmp)."""
    check_trusted_ancestry(root)
    st = os.stat(root)
    uid = os.getuid()
    shared = st.st_uid == 0 and st.st_mode & stat.S_ISVTX
    if st.st_uid != uid and not shared:
        raise UntrustedPathError(
            f"runtime directory {root} belongs to uid {st.st_uid}, not to us (uid {uid}) ({_describe(st)}); "
            "use a directory of your own (COMMD_RUNTIME_DIR)"
        )


def check_job_dir(directory: Path) -> None:
    """A job directory must be a real directory of ours that nobody else can enter (0700)."""
    uid = os.getuid()
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        raise ConfigError(f"job directory {directory} does not exist: is the job's daemon running?") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedPathError(f"job directory {directory} is not a directory ({_describe(st)})")
    if st.st_uid != uid:
        raise UntrustedPathError(
            f"job directory {directory} belongs to uid {st.st_uid}, not to us (uid {uid}): "
            f"refusing a job planted by another user ({_describe(st)})"
        )
    if st.st_mode & 0o077:
        raise UntrustedPathError(
            f"job directory {directory} is open to group or others (mode {stat.S_IMODE(st.st_mode):04o}, "
            "must be 0700): refusing it"
        )


def check_own_socket(path: Path) -> None:
    """A daemon socket must be a socket of ours that only we can use (0600)."""
    uid = os.getuid()
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist: is the job's daemon running?") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise UntrustedPathError(f"{path} is not a socket ({_describe(st)})")
    if st.st_uid != uid:
        raise UntrustedPathError(
            f"daemon socket {path} belongs to uid {st.st_uid}, not to us (uid {uid}): refusing to connect"
        )
    if st.st_mode & 0o077:
        raise UntrustedPathError(
            f"daemon socket {path} is open to group or others (mode {stat.S_IMODE(st.st_mode):04o}, "
            "must be 0600): refusing to connect"
        )


def read_private_file(path: Path, what: str) -> str:
    """The stripped text of a small regular file of ours that only we can read (no symlinks)."""
    uid = os.getuid()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise  # the caller knows what a missing file means
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UntrustedPathError(f"{what} {path} is a symlink: refusing to follow it") from None
        raise UntrustedPathError(f"cannot open {what} {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedPathError(f"{what} {path} is not a regular file ({_describe(st)})")
        if st.st_uid != uid:
            raise UntrustedPathError(f"{what} {path} belongs to uid {st.st_uid}, not to us (uid {uid})")
        if st.st_mode & 0o077:
            raise UntrustedPathError(
                f"{what} {path} is readable or writable by group or others (mode "
                f"{stat.S_IMODE(st.st_mode):04o}, must be 0600)"
            )
        data = f.read(MAX_SECRET_BYTES + 1)
    if len(data) > MAX_SECRET_BYTES:
        raise ConfigError(f"{what} {path} is larger than {MAX_SECRET_BYTES} bytes")
    try:
        text = data.decode().strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path} is not UTF-8 text") from None
    if not text:
        raise ConfigError(f"{what} {path} is empty")
    return text


def _private_dir(path: Path, follow_symlink: bool = False) -> Path:
    """Create ``path`` 0700 if needed; it must be ours (a loose mode of ours is tightened)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.stat(path) if follow_symlink else os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedPathError(f"runtime directory {path} is not a directory ({_describe(st)})")
    if st.st_uid != os.getuid():
        raise UntrustedPathError(
            f"runtime directory {path} belongs to uid {st.st_uid}, not to us (uid {os.getuid()}) "
            f"({_describe(st)})"
        )
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def _runtime_root_dir(root: Path) -> None:
    """Create the runtime root if needed; accept it if ours (made private) or shared and sticky."""
    check_trusted_ancestry(root)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_runtime_root(root)
    if os.stat(root).st_uid == os.getuid():
        _private_dir(root, follow_symlink=True)  # its ancestry, symlinks included, was checked above


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
        """Create the job's directory (0700); refuses a root or job directory that is not ours."""
        _runtime_root_dir(self.directory.parent)
        _private_dir(self.directory)
        if self.socket_dir != self.directory:
            _runtime_root_dir(self.socket_dir.parent)
            _private_dir(self.socket_dir)
        return self

    def verify(self) -> JobPaths:
        """Check, without changing anything, that nobody else can have planted this job's files."""
        check_runtime_root(self.directory.parent)
        check_job_dir(self.directory)
        if self.socket_dir != self.directory:
            check_runtime_root(self.socket_dir.parent)
            check_job_dir(self.socket_dir)
        return self

    @property
    def socket_dir(self) -> Path:
        """Where the job's sockets live: the job directory, unless a socket path in it would pass the
        ``MAX_SOCKET_PATH`` bytes a Unix socket address holds (a deep ``COMMD_RUNTIME_DIR``); then a short
        private directory named from the job directory's path, which daemon and clients compute alike."""
        if len(os.fsencode(self.directory / SOCKET_NAME)) <= MAX_SOCKET_PATH:
            return self.directory
        digest = hashlib.sha256(os.fsencode(os.path.abspath(self.directory))).hexdigest()[:24]
        return Path("/tmp") / f"commd-{os.getuid()}.sockets" / digest

    @property
    def socket(self) -> Path:
        return self.socket_dir / SOCKET_NAME

    @property
    def ops_socket(self) -> Path:
        return self.socket_dir / OPS_SOCKET_NAME

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
        """The job secret, after checking the directories and the file are ours and private."""
        try:
            self.verify()
            return read_private_file(self.secret_file, "job secret file")
        except FileNotFoundError:
            raise ConfigError(
                f"no secret for job {self.job!r} at {self.secret_file}: is its daemon running?"
            ) from None

    def write_secret(self, secret: str) -> None:
        fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
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


def secret_from_environment(consume: bool = False) -> str | None:
    """The job secret the user gave: $COMMD_SECRET, else the file named by $COMMD_SECRET_FILE.

    None when neither is set.  The file must be ours, a regular file and
    readable by nobody else (0600).  ``consume`` removes COMMD_SECRET from
    this process's environment, so the processes it starts do not inherit it.
    """
    raw = os.environ.pop(SECRET_ENV, None) if consume else os.environ.get(SECRET_ENV)
    if raw:
        secret, where = raw.strip(), SECRET_ENV
    else:
        path = os.environ.get(SECRET_FILE_ENV)
        if not path:
            return None
        try:
            secret = read_private_file(Path(path), f"{SECRET_FILE_ENV} file")
        except FileNotFoundError:
            raise ConfigError(f"{SECRET_FILE_ENV}={path!r} does not exist") from None
        where = f"{SECRET_FILE_ENV}={path!r}"
    if len(secret) < MIN_SECRET_CHARS or len(secret.encode()) > MAX_SECRET_BYTES:
        raise ConfigError(
            f"the job secret from {where} must be {MIN_SECRET_CHARS} to {MAX_SECRET_BYTES} characters "
            f"long (got {len(secret)}); e.g. `openssl rand -hex 32`"
        )
    return secret


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


def free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port the OS says is free on ``addr`` now (torchrun does the same; racy but good enough).

    An address this host cannot bind falls back to any address."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((addr, 0))
        except OSError:
            sock.bind(("", 0))
        return int(sock.getsockname()[1])
