"""Process plumbing shared by the commd tests: a daemon subprocess and worker processes.

The tests exercise commd the way a job does (a daemon process, client
processes talking to it over ZeroMQ and shared memory), so every helper
here is about starting those processes, talking to them with deadlines
instead of sleeps, and killing them whatever happens.
"""

from __future__ import annotations

import collections
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zmq

from commd.client.spawn import ping
from commd.protocol import schema as s
from commd.runtime import JobPaths, pid_alive

#: How long a daemon may take to answer its first ping (it imports torch).
DAEMON_START_S = 60.0
#: Default bound on one wait for a worker event or result.
WORKER_WAIT_S = 60.0
POLL_S = 0.02


def new_job() -> str:
    """A job name no other test (or concurrent run) uses."""
    return f"t{uuid.uuid4().hex[:12]}"


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``condition`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(POLL_S)


def job_paths(runtime_dir: Path, job: str) -> JobPaths:
    """JobPaths for ``job`` under ``runtime_dir`` without reading the environment."""
    return JobPaths(job, Path(runtime_dir) / job)


def shm_files(job: str) -> list[str]:
    """Shared-memory files whose names belong to ``job``'s clients."""
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:  # pragma: no cover - Linux always has it
        return []
    return sorted(n for n in names if n.startswith(f"commd-{job}-"))


# ---- the daemon ------------------------------------------------------------
@dataclass
class DaemonProcess:
    """A `python -m commd daemon` subprocess for one job in one runtime dir."""

    job: str
    runtime_dir: Path
    proc: subprocess.Popen
    paths: JobPaths

    @classmethod
    def start(
        cls, runtime_dir: Path, job: str, op_timeout: float = 20.0, extra: list[str] | None = None
    ) -> DaemonProcess:
        """Spawn the daemon; call ``wait_ready`` before connecting clients."""
        paths = job_paths(runtime_dir, job)
        paths.ensure()
        env = dict(os.environ, COMMD_RUNTIME_DIR=str(runtime_dir))
        env.pop("COMMD_SECRET", None)
        out = open(paths.directory / "daemon.out", "ab")  # handed to the child, closed below
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "commd", "daemon", "--job", job, "--op-timeout", str(op_timeout),
                 *(extra or [])],
                env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out, close_fds=True,
            )
        finally:
            out.close()
        return cls(job, Path(runtime_dir), proc, paths)

    def wait_ready(self, timeout: float = DAEMON_START_S) -> DaemonProcess:
        """Block until the daemon answers a ping with its own pid."""
        deadline = time.monotonic() + timeout
        while ping(self.paths, 0.2) != self.proc.pid:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"daemon did not answer within {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(POLL_S)
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def secret(self) -> str:
        return self.paths.read_secret()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = (self.paths.directory / "daemon.out").read_text(errors="replace")
        except OSError:
            return "(no daemon output)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers; always reaps the process."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


# ---- a raw protocol socket -------------------------------------------------
class RawSocket:
    """A bare DEALER socket on the daemon's control endpoint, for protocol tests."""

    def __init__(self, paths: JobPaths) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(paths.endpoint)

    def send_raw(self, frame: bytes) -> None:
        self.sock.send(frame)

    def send(self, message: dict[str, Any]) -> None:
        self.sock.send(s.encode(dict(message)))

    def recv(self, timeout: float = 10.0) -> dict[str, Any]:
        """The next reply (decoded without version checks), or fail after ``timeout``."""
        if not self.sock.poll(int(timeout * 1000)):
            raise AssertionError(f"no reply from the daemon within {timeout:.1f}s")
        return msgpack.unpackb(self.sock.recv(), raw=False)

    def request(self, message: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
        self.send(message)
        return self.recv(timeout)

    def silent(self, timeout: float) -> bool:
        """True if nothing arrives within ``timeout`` seconds."""
        return not self.sock.poll(int(timeout * 1000))

    def close(self) -> None:
        self.sock.close(linger=0)


class OpSocket:
    """A bare connection to the daemon's op socket (Unix SEQPACKET), for protocol tests.

    The daemon answers ops here, a burst of replies batched into one frame; ``recv``
    returns them one at a time.
    """

    def __init__(self, paths: JobPaths) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.connect(str(paths.ops_socket))
        self._pending: collections.deque[dict[str, Any]] = collections.deque()

    def attach(self, client_id: int, secret: str) -> dict[str, Any]:
        return self.request({"t": "attach", "client_id": client_id, "secret": secret})

    def send(self, message: dict[str, Any]) -> None:
        self.sock.send(s.encode(dict(message)))

    def recv(self, timeout: float = 10.0) -> dict[str, Any]:
        """The next reply (decoded without version checks), or fail after ``timeout``."""
        if self._pending:
            return self._pending.popleft()
        self.sock.settimeout(timeout)
        try:
            frame = self.sock.recv(2 * s.MAX_MESSAGE_BYTES)
        except TimeoutError:
            raise AssertionError(f"no reply on the op socket within {timeout:.1f}s") from None
        if not frame:
            raise AssertionError("the daemon closed the op socket")
        reply = msgpack.unpackb(frame, raw=False)
        if reply.get("t") == s.BATCH:
            self._pending.extend(reply["items"])
            return self._pending.popleft()
        return reply

    def request(self, message: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
        self.send(message)
        return self.recv(timeout)

    def close(self) -> None:
        self.sock.close()


# ---- worker processes ------------------------------------------------------
class WorkerContext:
    """What a worker target gets: its rank, job, and a channel to the test."""

    def __init__(self, rank: int, world_size: int, job: str, runtime_dir: str, conn: Any) -> None:
        self.rank = rank
        self.world_size = world_size
        self.job = job
        self.runtime_dir = runtime_dir
        self._conn = conn

    def event(self, name: str, payload: Any = None) -> None:
        """Tell the test process something happened (e.g. 'submitted')."""
        self._conn.send(("event", self.rank, name, payload))

    def command(self, timeout: float = WORKER_WAIT_S) -> Any:
        """Wait for the next command from the test process."""
        if not self._conn.poll(timeout):
            raise TimeoutError(f"rank {self.rank}: no command from the test within {timeout:.0f}s")
        return self._conn.recv()

    def connect(self, groups: dict[str, list[int]] | None = None, **kwargs: Any) -> Any:
        """A commd Client for this rank, once the daemon answers; registers 'world' too."""
        from commd.client import Client

        paths = job_paths(Path(self.runtime_dir), self.job)
        wait_until(lambda: ping(paths, 0.2), DAEMON_START_S, "the daemon to answer")
        nodes = os.environ.get("COMMD_TEST_NODES")
        if nodes and "nodes" not in kwargs:
            kwargs["nodes"] = nodes.split(",")
        client = Client(self.rank, self.world_size, job=self.job, **kwargs)
        client.register_group("world", list(range(self.world_size)))
        for name, ranks in (groups or {}).items():
            if self.rank in ranks:
                client.register_group(name, ranks)
        return client


def enter_netns(name: str) -> None:
    """Move this (single-threaded) process into network namespace ``name`` (a simulated host)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    clone_newnet = 0x40000000
    with open(f"/var/run/netns/{name}") as ns:
        if libc.setns(ns.fileno(), clone_newnet) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name} failed")


def _child_main(
    conn: Any, rank: int, world_size: int, job: str, runtime_dir: str,
    target: Callable[..., Any], args: tuple[Any, ...], env: dict[str, str] | None = None,
    netns: str | None = None,
) -> None:
    """Entry point of every worker: set the environment, run the target, report."""
    if netns:
        enter_netns(netns)
    os.environ.update(env or {})
    os.environ["COMMD_RUNTIME_DIR"] = runtime_dir
    os.environ.pop("COMMD_JOB", None)
    ctx = WorkerContext(rank, world_size, job, runtime_dir, conn)
    try:
        value = target(ctx, *args)
        conn.send(("result", rank, True, value))
    except BaseException:  # every failure goes back to the test
        conn.send(("result", rank, False, traceback.format_exc()))
    finally:
        conn.close()


class WorkerFailed(AssertionError):
    """One or more workers raised, died or did not finish in time."""


@dataclass
class Workers:
    """Worker processes (spawn context) running ``target(ctx, *args)``, one per rank."""

    target: Callable[..., Any]
    world_size: int
    job: str
    runtime_dir: Path
    args: tuple[Any, ...] = ()
    ranks: list[int] | None = None
    env: dict[str, str] | None = None
    netns: str | None = None
    procs: dict[int, Any] = field(default_factory=dict)
    conns: dict[int, Any] = field(default_factory=dict)
    events: dict[tuple[int, str], Any] = field(default_factory=dict)
    results: dict[int, tuple[bool, Any]] = field(default_factory=dict)

    def start(self) -> Workers:
        ctx = multiprocessing.get_context("spawn")
        for rank in self.ranks if self.ranks is not None else range(self.world_size):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_child_main,
                args=(child, rank, self.world_size, self.job, str(self.runtime_dir), self.target, self.args,
                      self.env, self.netns),
                name=f"commd-test-rank{rank}", daemon=True,
            )
            proc.start()
            child.close()
            self.procs[rank], self.conns[rank] = proc, parent
        return self

    def _pump(self, timeout: float) -> None:
        """Receive whatever the workers sent within ``timeout``; note dead channels."""
        live = [c for c in self.conns.values() if not c.closed]
        if not live:
            return
        for conn in multiprocessing.connection.wait(live, timeout):
            rank = next(r for r, c in self.conns.items() if c is conn)
            try:
                message = conn.recv()
            except (EOFError, OSError):
                conn.close()
                if rank not in self.results:
                    code = self.procs[rank].exitcode
                    self.results[rank] = (False, f"rank {rank} died without a result (exit code {code})")
                continue
            if message[0] == "event":
                self.events[(message[1], message[2])] = message[3]
            else:
                self.results[message[1]] = (message[2], message[3])

    def wait_event(self, rank: int, name: str, timeout: float = WORKER_WAIT_S) -> Any:
        """The payload of event ``name`` from ``rank``; fail if it does not come in time."""
        deadline = time.monotonic() + timeout
        while (rank, name) not in self.events:
            if rank in self.results:
                ok, value = self.results[rank]
                raise WorkerFailed(f"rank {rank} finished before event {name!r}: {value}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerFailed(f"rank {rank} did not report {name!r} within {timeout:.0f}s")
            self._pump(min(remaining, 0.5))
        return self.events[(rank, name)]

    def send(self, rank: int, command: Any) -> None:
        self.conns[rank].send(command)

    def join(self, timeout: float = WORKER_WAIT_S, ranks: list[int] | None = None) -> dict[int, Any]:
        """Every listed rank's return value; raise WorkerFailed with all tracebacks otherwise."""
        wanted = list(ranks if ranks is not None else self.procs)
        deadline = time.monotonic() + timeout
        while any(r not in self.results for r in wanted) and time.monotonic() < deadline:
            self._pump(min(0.5, max(0.0, deadline - time.monotonic())))
        problems = []
        for rank in wanted:
            if rank not in self.results:
                problems.append(f"rank {rank}: no result within {timeout:.0f}s")
            elif not self.results[rank][0]:
                problems.append(f"rank {rank} failed:\n{self.results[rank][1]}")
        if problems:
            raise WorkerFailed("\n".join(problems))
        for rank in wanted:
            self.procs[rank].join(timeout=10)
        return {rank: self.results[rank][1] for rank in wanted}

    def kill(self, rank: int) -> None:
        """SIGKILL one worker (simulates a crashed training process)."""
        proc = self.procs[rank]
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=10)

    def close(self) -> None:
        """Kill and reap every worker still running (finalizer: runs even on failure)."""
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
        for proc in self.procs.values():
            proc.join(timeout=10)
        for conn in self.conns.values():
            conn.close()


def kill_pid(pid: int, timeout: float = 10.0) -> None:
    """SIGTERM ``pid``, then SIGKILL if it is still alive after ``timeout``."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    if pid_alive(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def msccl_files_dir() -> Path | None:
    """The third-party MSCCL files the algorithm tests read: ``$COMMD_MSCCL_FILES``, else
    ``shared/msccl`` beside the checkout or up to two folders above it; None where there are none
    (the tests that need them skip)."""
    if os.environ.get("COMMD_MSCCL_FILES"):
        return Path(os.environ["COMMD_MSCCL_FILES"])
    root = Path(__file__).resolve().parent.parent
    for base in (root, *root.parents[:2]):
        if (base / "shared" / "msccl").is_dir():
            return base / "shared" / "msccl"
    return None

