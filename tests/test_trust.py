"""Whom commd trusts: job directories, daemon sockets and processes, and where the job secret lives.

A client must refuse a job directory, socket or daemon process that is not
its user's own before it sends anything (the job secret in the hello, then
tensors); a daemon must refuse to start where someone else could replace its
files; the job secret must never travel through the rendezvous store.  Fakes
here record whether anything reached them, so "refused" also means "nothing
was sent".  Tests that hand files to another uid need root (they skip
otherwise).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
import zmq
from cluster import free_port
from helpers import DaemonProcess, job_paths, new_job

from commd.client import Client
from commd.client.errors import ConnectError
from commd.runtime import ConfigError, JobPaths, new_secret

OTHER_UID = 65534  # nobody
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="handing files to another uid needs root")
CONNECT_TIMEOUT_S = 3.0
#: How long a fake waits for anything a refused client might still send.
LISTEN_AFTER_S = 0.5
SPAWN_TIMEOUT_S = 100.0


class FakeDaemon:
    """Sockets where a job's daemon would be, recording whatever reaches them.

    ``control.sock`` is a ZeroMQ ROUTER (where the hello with the secret
    goes), ``ops.sock`` a listening SEQPACKET socket (where ops go).
    """

    def __init__(self, directory: Path, ops_listener: bool = True) -> None:
        self.directory = directory
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.ctx = zmq.Context.instance()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"ipc://{directory / 'control.sock'}")
        os.chmod(directory / "control.sock", 0o600)
        self.ops: socket.socket | None = None
        if ops_listener:
            self.ops = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self.ops.bind(str(directory / "ops.sock"))
            os.chmod(directory / "ops.sock", 0o600)
            self.ops.listen(8)
            self.ops.setblocking(False)
        secret = directory / "secret"
        secret.write_text("planted-secret-of-the-attacker")
        secret.chmod(0o600)

    def received(self) -> list[str]:
        """What reached the fake within LISTEN_AFTER_S: 'control message' / 'op connection' entries."""
        seen = []
        deadline = time.monotonic() + LISTEN_AFTER_S
        while time.monotonic() < deadline:
            if self.router.poll(10):
                self.router.recv_multipart()
                seen.append("control message")
            if self.ops is not None:
                try:
                    conn, _ = self.ops.accept()
                    conn.close()
                    seen.append("op connection")
                except BlockingIOError:
                    pass
        return seen

    def close(self) -> None:
        self.router.close()
        if self.ops is not None:
            self.ops.close()


@pytest.fixture
def fakes() -> Iterator[list[FakeDaemon]]:
    made: list[FakeDaemon] = []
    yield made
    for fake in made:
        fake.close()


def _chown_tree(path: Path, uid: int) -> None:
    for entry in [path, *path.iterdir()]:
        os.lchown(entry, uid, uid)


def _connect(job: str) -> Client:
    return Client(0, 1, job=job, connect_timeout=CONNECT_TIMEOUT_S)


# ---- planted job directories ------------------------------------------------------------------
@needs_root
def test_job_directory_of_another_user_is_refused_before_anything_is_sent(
    runtime_dir: Path, fakes: list[FakeDaemon]
) -> None:
    job = new_job()
    fake = FakeDaemon(runtime_dir / job)
    fakes.append(fake)
    (fake.directory / "daemon.pid").write_text(str(os.getpid()))
    _chown_tree(fake.directory, OTHER_UID)
    with pytest.raises(ConnectError, match=f"{fake.directory}.*uid {OTHER_UID}") as refused:
        _connect(job)
    assert refused.typename == "UntrustedDaemonError"
    assert fake.received() == []


def test_job_directory_open_to_others_is_refused(runtime_dir: Path, fakes: list[FakeDaemon]) -> None:
    job = new_job()
    fake = FakeDaemon(runtime_dir / job)
    fakes.append(fake)
    fake.directory.chmod(0o777)
    with pytest.raises(ConnectError, match=f"{fake.directory}.*mode 0777"):
        _connect(job)
    assert fake.received() == []


@needs_root
def test_runtime_root_of_another_user_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fakes: list[FakeDaemon]
) -> None:
    root = tmp_path / "planted-root"
    job = new_job()
    fake = FakeDaemon(root / job)
    fakes.append(fake)
    os.chown(root, OTHER_UID, OTHER_UID)
    monkeypatch.setenv("COMMD_RUNTIME_DIR", str(root))
    with pytest.raises(ConnectError, match=f"{root}.*uid {OTHER_UID}"):
        _connect(job)
    assert fake.received() == []


def test_runtime_root_under_a_directory_anyone_can_write_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fakes: list[FakeDaemon]
) -> None:
    """Anyone may rename entries of a world-writable, non-sticky directory: nothing below it is ours."""
    open_dir = tmp_path / "open"
    root = open_dir / "rt"
    job = new_job()
    fake = FakeDaemon(root / job)
    fakes.append(fake)
    root.chmod(0o700)
    open_dir.chmod(0o777)
    monkeypatch.setenv("COMMD_RUNTIME_DIR", str(root))
    with pytest.raises(ConnectError, match=f"{open_dir} is writable by group or others and not sticky"):
        _connect(job)
    assert fake.received() == []
    # ... and a daemon refuses to start there
    proc = subprocess.run([sys.executable, "-m", "commd", "daemon", "--job", new_job()],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"{open_dir} is writable by group or others" in proc.stderr, proc.stderr


@needs_root
def test_runtime_root_reached_through_another_users_symlink_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fakes: list[FakeDaemon]
) -> None:
    """A symlink planted in a shared sticky directory (like /tmp/commd-<uid>) can be re-pointed by its
    owner at any moment, even when it points at a directory of ours now."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    ours = tmp_path / "ours"
    job = new_job()
    fake = FakeDaemon(ours / job)
    fakes.append(fake)
    ours.chmod(0o700)
    link = shared / "commd-root"
    link.symlink_to(ours)
    os.lchown(link, OTHER_UID, OTHER_UID)
    monkeypatch.setenv("COMMD_RUNTIME_DIR", str(link))
    with pytest.raises(ConnectError, match=f"{link} is a symlink of uid {OTHER_UID}"):
        _connect(job)
    assert fake.received() == []


@needs_root
def test_daemon_refuses_a_runtime_root_of_another_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "theirs"
    root.mkdir(mode=0o755)
    os.chown(root, OTHER_UID, OTHER_UID)
    monkeypatch.setenv("COMMD_RUNTIME_DIR", str(root))
    proc = subprocess.run([sys.executable, "-m", "commd", "daemon", "--job", new_job()],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"{root}" in proc.stderr and f"uid {OTHER_UID}" in proc.stderr, proc.stderr
    assert list(root.iterdir()) == []  # nothing was created in their directory


# ---- daemon sockets and processes ---------------------------------------------------------------
@needs_root
@pytest.mark.parametrize("which", ["ops.sock", "control.sock"])
def test_daemon_socket_of_another_user_is_refused(daemon: DaemonProcess, which: str) -> None:
    sock = daemon.paths.directory / which
    os.lchown(sock, OTHER_UID, OTHER_UID)
    with pytest.raises(ConnectError, match=f"{sock} belongs to uid {OTHER_UID}"):
        _connect(daemon.job)
    os.lchown(sock, os.getuid(), os.getgid())
    client = _connect(daemon.job)  # the same daemon, its socket ours again: accepted
    client.close()


_LISTEN_AS_OTHER = """
import os, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
sock.bind(sys.argv[1])
os.chmod(sys.argv[1], 0o600)
os.setgid({uid}); os.setuid({uid})
sock.listen(8)  # SO_PEERCRED names whoever called listen()
print("ready", flush=True)
sys.stdin.read()
"""


@needs_root
def test_op_channel_listened_on_by_another_uid_is_refused(runtime_dir: Path, fakes: list[FakeDaemon]) -> None:
    """Every file is ours and private, but the process behind ops.sock is another user's."""
    job = new_job()
    fake = FakeDaemon(runtime_dir / job, ops_listener=False)
    fakes.append(fake)
    ops = fake.directory / "ops.sock"
    proc = subprocess.Popen([sys.executable, "-c", _LISTEN_AS_OTHER.format(uid=OTHER_UID), str(ops)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        with pytest.raises(ConnectError, match=f"{ops}.*pid {proc.pid}.*uid {OTHER_UID}"):
            _connect(job)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    assert fake.received() == []  # no hello (with the secret) went to control.sock


def test_op_channel_of_a_process_other_than_the_recorded_daemon_is_refused(
    runtime_dir: Path, fakes: list[FakeDaemon]
) -> None:
    job = new_job()
    fake = FakeDaemon(runtime_dir / job)
    fakes.append(fake)
    (fake.directory / "daemon.pid").write_text(str(os.getppid()))  # alive, but not who listens
    with pytest.raises(ConnectError, match=f"pid {os.getpid()}.*names pid {os.getppid()}"):
        _connect(job)
    assert "control message" not in fake.received()  # no hello (with the secret) went out


def test_stale_sockets_of_a_dead_daemon_fail_at_once(runtime_dir: Path, fakes: list[FakeDaemon]) -> None:
    """A crashed daemon's files: ops.sock refuses and daemon.pid names a dead process."""
    job = new_job()
    fake = FakeDaemon(runtime_dir / job, ops_listener=False)
    fakes.append(fake)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stale.bind(str(fake.directory / "ops.sock"))  # bound, never listening: connections are refused
    os.chmod(fake.directory / "ops.sock", 0o600)
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=30)
    (fake.directory / "daemon.pid").write_text(str(dead.pid))
    started = time.monotonic()
    try:
        with pytest.raises(ConnectError, match=f"no commd daemon answers for job '{job}'"):
            Client(0, 1, job=job, connect_timeout=30)
    finally:
        stale.close()
    assert time.monotonic() - started < 10, "waited for the connect timeout instead of failing at once"
    assert fake.received() == []


# ---- the secret file ----------------------------------------------------------------------------
def test_secret_file_must_be_a_private_regular_file_of_ours(runtime_dir: Path, tmp_path: Path) -> None:
    paths = job_paths(runtime_dir, new_job()).ensure()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("x" * 64)
    elsewhere.chmod(0o600)
    paths.secret_file.symlink_to(elsewhere)
    with pytest.raises(ConfigError, match=f"{paths.secret_file} is a symlink"):
        paths.read_secret()
    paths.secret_file.unlink()
    paths.write_secret("s" * 64)
    paths.secret_file.chmod(0o644)
    with pytest.raises(ConfigError, match=f"{paths.secret_file}.*mode 0644"):
        paths.read_secret()
    paths.secret_file.chmod(0o600)
    assert paths.read_secret() == "s" * 64
    if os.getuid() == 0:
        os.chown(paths.secret_file, OTHER_UID, OTHER_UID)
        with pytest.raises(ConfigError, match=f"{paths.secret_file} belongs to uid {OTHER_UID}"):
            paths.read_secret()


# ---- the secret and the store -------------------------------------------------------------------
def _base_store(store: dist.Store) -> dist.Store:
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def _rank_checks_store(rank: int, world: int, init_method: str, out: str) -> None:
    from commd.torch_backend.process_group import current_client

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("commd", init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.all(t == world * (world + 1) / 2)
    secret = current_client().paths.read_secret()
    store = _base_store(dist.distributed_c10d._get_default_store())
    # every key the store lists (FileStore also lists its internal 'efcount/', which has no value)
    values = {key: store.get(key) for key in store.list_keys() if store.check([key])}
    leaked = sorted(key for key, value in values.items() if secret.encode() in value)
    lines = [f"keys {len(values)}", f"leaked {leaked}"]
    if isinstance(store, dist.FileStore):
        data = Path(store.path).read_bytes()
        lines += [f"file_mode {os.stat(store.path).st_mode & 0o777:04o}", f"in_file {secret.encode() in data}"]
    dist.barrier()
    Path(out, f"rank{rank}.txt").write_text("\n".join(lines))
    dist.destroy_process_group()


def _spawn(fn, args: tuple) -> None:
    context = tmp.spawn(fn, args=args, nprocs=2, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                raise AssertionError(f"ranks did not finish within {SPAWN_TIMEOUT_S:.0f}s")
    finally:
        for proc in context.processes:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)


@pytest.fixture
def torch_env(runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "COMMD_JOB", "COMMD_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)
    yield runtime_dir
    for pid_file in runtime_dir.glob("*/daemon.pid"):
        try:
            os.kill(int(pid_file.read_text()), 9)
        except (OSError, ValueError):
            pass


@pytest.mark.parametrize("init", ["file", "tcp"])
def test_torch_init_never_puts_the_secret_in_the_store(torch_env: Path, tmp_path: Path, init: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    if init == "file":
        init_method = f"file://{tmp_path / 'store'}"
    else:
        init_method = f"tcp://127.0.0.1:{free_port()}"
    _spawn(_rank_checks_store, (2, init_method, str(out)))
    for rank in range(2):
        report = dict(line.split(" ", 1) for line in (out / f"rank{rank}.txt").read_text().splitlines())
        assert int(report["keys"]) > 0, report  # the store was read: the check below is not vacuous
        assert report["leaked"] == "[]", f"store keys holding the job secret: {report['leaked']}"
        if init == "file":
            assert report["in_file"] == "False", "the job secret is in the file:// store's file"
            assert report["file_mode"] == "0600", f"file:// store file mode {report['file_mode']}"


# ---- several nodes: a secret must be given --------------------------------------------------------
def _daemon_env(runtime: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, COMMD_RUNTIME_DIR=str(runtime), **extra)
    for key in ("COMMD_SECRET", "COMMD_SECRET_FILE", "COMMD_JOB"):
        if key not in extra:
            env.pop(key, None)
    return env


def test_multi_node_daemon_without_a_secret_refuses_and_publishes_nothing(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "commd", "daemon", "--job", new_job(), "--nnodes", "2", "--node-rank", "0",
            "--rendezvous", f"127.0.0.1:{port}", "--rendezvous-timeout", "5"]
    started = time.monotonic()
    proc = subprocess.run(argv, env=_daemon_env(tmp_path / "rt"), capture_output=True, text=True, timeout=90)
    assert proc.returncode == 1, proc.stderr
    assert "COMMD_SECRET" in proc.stderr and "store" in proc.stderr, proc.stderr
    assert time.monotonic() - started < 60  # refused at once, not after waiting for node 1
    with socket.socket() as probe:  # it never hosted the store that would have carried the secret
        assert probe.connect_ex(("127.0.0.1", port)) != 0


def test_secret_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text(new_secret())
    secret_file.chmod(0o644)
    argv = [sys.executable, "-m", "commd", "daemon", "--job", new_job(), "--nnodes", "2", "--node-rank", "0",
            "--rendezvous", f"127.0.0.1:{free_port()}", "--rendezvous-timeout", "5"]
    proc = subprocess.run(argv, env=_daemon_env(tmp_path / "rt", COMMD_SECRET_FILE=str(secret_file)),
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 2, proc.stderr
    assert f"{secret_file}" in proc.stderr and "mode 0644" in proc.stderr, proc.stderr


def test_launch_on_several_nodes_without_a_secret_is_refused(tmp_path: Path) -> None:
    script = tmp_path / "noop.py"
    script.write_text("")
    argv = [sys.executable, "-m", "commd", "launch", "--nnodes", "2", "--node-rank", "0",
            "--master", f"127.0.0.1:{free_port()}", str(script)]
    proc = subprocess.run(argv, env=_daemon_env(tmp_path / "rt"), capture_output=True, text=True, timeout=90)
    assert proc.returncode == 2, proc.stderr
    assert "COMMD_SECRET" in proc.stderr, proc.stderr


_TORCHRUN_RANK = """
import sys
from datetime import timedelta
import torch.distributed as dist
import commd
try:
    dist.init_process_group("commd", timeout=timedelta(seconds=30))
except Exception as exc:
    print("REFUSED", type(exc).__name__, exc, flush=True)
    sys.exit(3)
print("JOINED", flush=True)
"""


def test_torch_ranks_on_several_nodes_without_a_secret_all_fail_naming_the_ranks(tmp_path: Path) -> None:
    """Rank 1 has a secret, rank 0 has none: both fail at once, naming rank 0; no daemon starts."""
    port = free_port()
    procs = []
    for rank in range(2):
        runtime = tmp_path / f"node{rank}"
        extra = {"COMMD_SECRET": new_secret()} if rank == 1 else {}
        env = _daemon_env(runtime, COMMD_NODE=f"n{rank}", RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra)
        procs.append(subprocess.Popen([sys.executable, "-c", _TORCHRUN_RANK], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [proc.communicate(timeout=100)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 3, output
        assert "REFUSED ConnectError" in output and "rank 0: neither COMMD_SECRET" in output, output
        assert "rank 1:" not in output, output
    assert not list(tmp_path.glob("node*/*/daemon.pid")), "a daemon was started"


def test_status_refuses_a_planted_job(runtime_dir: Path, fakes: list[FakeDaemon]) -> None:
    from commd.cli.status import StatusError, query_status

    job = new_job()
    fake = FakeDaemon(runtime_dir / job)
    fakes.append(fake)
    fake.directory.chmod(0o755)
    with pytest.raises(StatusError, match="mode 0755"):
        query_status(JobPaths(job, fake.directory), timeout=2)
    assert fake.received() == []
