"""Deployment: Slurm prolog/epilog from slurmd's bare environment, systemd readiness and unit file.

The Slurm tests run the scripts as slurmd does: as root, under ``env -i`` with
only SLURM_JOB_ID/UID/USER/NODELIST (plus COMMD_SLURM_CONF, the test's site
config), for the job user ``nobody``; the job's ranks run as ``nobody`` too.
Where this checkout or its interpreter sits under a directory ``nobody`` cannot
enter (/root, or a clone inside a 0700 directory), each "node" gets a private
mount namespace exposing just those trees (``node_view``), so the job user runs
the same files from the same paths, as on a cluster node; if it still cannot
run this checkout's Python, the Slurm tests skip and say what it needs.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import os
import pwd
import random
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import new_job, wait_until

from commd.cli.main import main as commd_main
from commd.client import Client, ops
from commd.client.errors import ConnectError, UntrustedDaemonError
from commd.daemon import notify
from commd.deploy.slurm import HostListError, expand_hostlist, job_secret, node_rank, plan, rendezvous_port
from commd.runtime import JobPaths, pid_alive

REPO = Path(__file__).resolve().parent.parent
SLURM_DIR = REPO / "deploy" / "slurm"
UNIT = REPO / "deploy" / "commd@.service"
USER_DROPIN = REPO / "deploy" / "commd@.service.d" / "user.conf.example"
WORKER = REPO / "tests" / "scripts" / "slurm_job_worker.py"
JOB_USER = "nobody"


# ---- host lists, node rank, secrets (no root needed) -------------------------------------------
@pytest.mark.parametrize(("text", "hosts"), [
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("single", ["single"]),
    ("a,b-c.d,e_f", ["a", "b-c.d", "e_f"]),
    (" n[1,3] ", ["n1", "n3"]),
])
def test_expand_hostlist(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(("text", "error"), [
    ("", "empty"),
    ("n[1-", "unclosed"),
    ("n]1", "unmatched"),
    ("n[[1]]", "nested"),
    ("n[2-1]", "backwards"),
    ("n[a-b]", "bad range"),
    ("n[1-2],n2", "twice"),
    ("a,,b", "empty entry"),
    ("bad!name", "invalid"),
    ("n[0-99999999]", "more than"),
    ("a[1-300]b[1-300]", "more than"),
])
def test_expand_hostlist_rejects(text: str, error: str) -> None:
    with pytest.raises(HostListError, match=error):
        expand_hostlist(text)


def test_node_rank_and_plan() -> None:
    hosts = expand_hostlist("localhost,other[1-2]")
    assert node_rank(hosts, "other2") == 2
    with pytest.raises(HostListError, match="'nothere' is not in the job's node list"):
        node_rank(hosts, "nothere")
    assert plan("localhost,other[1-2]", "other1", "1234", 41000, 1000) == {
        "NNODES": "3", "NODE_RANK": "1", "NODE0": "localhost", "RENDEZVOUS": "127.0.0.1:41234",
    }
    assert plan("localhost", "localhost", "7", 41000, 1000) == {"NNODES": "1", "NODE_RANK": "0", "NODE0": "localhost"}
    assert rendezvous_port("123456", 50000, 100) == 50056
    with pytest.raises(HostListError, match="port range"):
        rendezvous_port("1", 65000, 1000)
    with pytest.raises(HostListError, match="not a number"):
        plan("localhost", "localhost", "12a", 41000, 1000)


def test_slurm_plan_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert commd_main(["slurm-plan", "--nodelist", "localhost,b[1-2]", "--node", "b2", "--job-id", "5"]) == 0
    assert capsys.readouterr().out.splitlines() == ["NNODES=3", "NODE_RANK=2", "NODE0=localhost",
                                                    "RENDEZVOUS=127.0.0.1:41005"]
    assert commd_main(["slurm-plan", "--nodelist", "b[1-2", "--node", "b1", "--job-id", "5"]) == 2
    assert "unclosed '['" in capsys.readouterr().err


def test_prolog_hmac_matches_python() -> None:
    """The prolog derives a job's secret in bash (as root); it must equal HMAC-SHA256 as Python computes it."""
    script = (SLURM_DIR / "commd-slurm.sh").read_text()
    function = re.search(r"^hmac_sha256\(\) \{.*?^\}$", script, re.S | re.M)
    assert function, "hmac_sha256 not found in commd-slurm.sh"
    for key in ("0123456789abcdef0123456789abcdef", "f" * 64, os.urandom(32).hex()):
        for job_id in ("1", "987654321"):
            out = subprocess.run(
                ["env", "-i", "PATH=/usr/bin:/bin", "bash", "-c", function.group(0) + '\nhmac_sha256 "$1" "$2"',
                 "bash", key, f"commd-slurm-job:{job_id}"],
                capture_output=True, text=True, timeout=30, check=True,
            ).stdout.strip()
            reference = hmac.new(key.encode(), f"commd-slurm-job:{job_id}".encode(), hashlib.sha256).hexdigest()
            assert out == reference == job_secret(key, job_id)


# ---- systemd readiness ---------------------------------------------------------------------------
@pytest.fixture
def notify_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A fake service manager: a datagram socket named by NOTIFY_SOCKET."""
    directory = tempfile.mkdtemp(prefix="commd-notify-")
    path = os.path.join(directory, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(90)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    yield sock
    sock.close()
    shutil.rmtree(directory, ignore_errors=True)


def test_notify_path_and_abstract(notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch) -> None:
    assert notify.notify("READY=1")
    assert notify_socket.recv(4096) == b"READY=1"
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"commd-test-{os.getpid()}-{random.randrange(1 << 30)}"
    abstract.bind("\0" + name)
    abstract.settimeout(10)
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify.stopping("signal SIGTERM")
        assert abstract.recv(4096) == b"STOPPING=1\nSTATUS=stopping: signal SIGTERM"
    finally:
        abstract.close()
    monkeypatch.setenv("NOTIFY_SOCKET", "relative/path")
    assert not notify.notify("READY=1")
    monkeypatch.setenv("NOTIFY_SOCKET", "/nonexistent/notify")
    assert not notify.notify("READY=1")
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert not notify.notify("READY=1")


def test_daemon_notifies_ready_and_stopping(runtime_dir: Path, notify_socket: socket.socket) -> None:
    """Type=notify: READY=1 once the control socket accepts clients, STOPPING=1 when SIGTERM arrives."""
    job = new_job()
    proc = subprocess.Popen([sys.executable, "-m", "commd", "daemon", "--job", job],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        try:
            ready = notify_socket.recv(4096).decode()
        except TimeoutError:
            pytest.fail("the daemon sent nothing to NOTIFY_SOCKET within 90 s")
        assert ready.splitlines()[0] == "READY=1" and f"serving job {job}" in ready
        paths = JobPaths.for_job(job)
        assert paths.socket.exists() and paths.secret_file.exists(), "READY=1 before the daemon can be reached"
        client = Client(0, 1, job=job)  # it serves
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert notify_socket.recv(4096).decode().startswith("STOPPING=1\n")
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- clients and a daemon a prologue started ----------------------------------------------------
def test_client_reports_a_failed_start(runtime_dir: Path) -> None:
    """A start that failed left its reason: the client raises it instead of 'no secret'."""
    paths = JobPaths.for_job(new_job()).ensure()
    (paths.directory / "start.error").write_text("on node n1: COMMD_BIN=/x/commd is not an executable file\n")
    started = time.monotonic()
    with pytest.raises(ConnectError, match="could not be started: on node n1: COMMD_BIN=/x/commd is not an"):
        Client(0, 1, job=paths.job, connect_timeout=30)
    assert time.monotonic() - started < 10


def test_client_gives_up_on_a_start_that_never_ends(runtime_dir: Path) -> None:
    paths = JobPaths.for_job(new_job()).ensure()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        (paths.directory / "starting").write_text(str(sleeper.pid))
        paths.log_file.write_text("waiting for node 1\n")
        started = time.monotonic()
        with pytest.raises(ConnectError, match=r"still starting after 2s(.|\n)*waiting for node 1"):
            Client(0, 1, job=paths.job, connect_timeout=2)
        assert 1.9 <= time.monotonic() - started < 20
    finally:
        sleeper.kill()
        sleeper.wait()


def test_client_waits_for_a_starting_daemon(runtime_dir: Path) -> None:
    """Ranks may start before the prologue's detached daemon serves: they wait for it."""
    paths = JobPaths.for_job(new_job()).ensure()
    proc = subprocess.Popen([sys.executable, "-m", "commd", "daemon", "--job", paths.job],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        (paths.directory / "starting").write_text(str(proc.pid))
        assert not paths.secret_file.exists(), "the daemon bound before the client looked: nothing tested"
        client = Client(0, 1, job=paths.job, connect_timeout=90)
        client.register_group("world", [0])
        t = torch.arange(10, dtype=torch.float32)
        ops.all_reduce(client, t).wait(30)
        assert torch.equal(t, torch.arange(10, dtype=torch.float32))
        client.close()
    finally:
        proc.terminate()
        proc.wait(30)


TORCH_RANK = """
import sys
from datetime import timedelta
import torch, torch.distributed as dist
import commd  # registers the backend
try:
    dist.init_process_group("commd", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    t = torch.ones(3)
    dist.all_reduce(t)
    print("OK", flush=True)
except Exception as exc:
    print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
"""


def test_torch_backend_reports_a_failed_prologue_start(runtime_dir: Path, tmp_path: Path) -> None:
    """With COMMD_JOB naming a job whose prologue start failed, the backend fails with that reason
    instead of quietly spawning a daemon of its own (which would serve a different fabric)."""
    paths = JobPaths.for_job(new_job()).ensure()
    (paths.directory / "start.error").write_text("on node n0: cannot plan the daemon: bad node list\n")
    env = dict(os.environ, COMMD_JOB=paths.job)
    done = subprocess.run([sys.executable, "-c", TORCH_RANK, str(tmp_path / "store")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert "could not be started: on node n0: cannot plan the daemon: bad node list" in done.stdout, (
        done.stdout + done.stderr)


# ---- containers: what the daemon and the ranks must share ----------------------------------------
def _namespaces_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "making mount and PID namespaces needs root"
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    return None


needs_namespaces = pytest.mark.skipif(_namespaces_unavailable() is not None, reason=str(_namespaces_unavailable()))

# The daemon's "container": its own /tmp and /dev/shm (empty tmpfs), the runtime directory the only
# thing shared with the ranks, bound at the same path (like a volume mounted into two containers);
# also bound back: the interpreter's and this checkout's trees where they lie under /tmp.
# Arguments: N, N paths to keep, the command.
OWN_MOUNTS = r"""
set -e
n=$1
shift
keeps=() temps=()
for ((i = 0; i < n; i++)); do
    t=$(mktemp -d /var/tmp/commd-hold.XXXXXX)
    mount --bind "$1" "$t"
    keeps+=("$1") temps+=("$t")
    shift
done
mount -t tmpfs -o size=1m tmpfs /tmp
mount -t tmpfs -o size=1m tmpfs /dev/shm
for i in "${!keeps[@]}"; do
    mkdir -p "${keeps[$i]}"
    mount --move "${temps[$i]}" "${keeps[$i]}"
    rmdir "${temps[$i]}"
done
exec "$@"
"""


def _own_mounts(runtime_dir: Path) -> list[str]:
    tmp = Path("/tmp")
    trees = sorted({str(tmp / p.relative_to(tmp).parts[0]) for p in _job_user_paths() if p.is_relative_to(tmp)})
    keeps = [*trees, str(runtime_dir)]
    return ["unshare", "--mount", "--propagation", "private", "bash", "-c", OWN_MOUNTS, "bash", str(len(keeps)),
            *keeps]


def _one_rank(job: str) -> float:
    """A rank: an all-reduce staged through shared memory (above the inline limit) through the job's daemon."""
    client = Client(0, 1, job=job, connect_timeout=60)
    try:
        client.register_group("world", [0])
        t = torch.full((300_000,), 2.5)
        ops.all_reduce(client, t).wait(60)
        return float(t[-1])
    finally:
        client.close()


def _contained_daemon(wrapper: list[str], job: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([*wrapper, sys.executable, "-m", "commd", "daemon", "--job", job],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    paths = JobPaths.for_job(job)
    wait_until(lambda: (paths.ops_socket.exists() and paths.pid_file.exists()) or proc.poll() is not None, 90,
               "the daemon to serve")
    assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
    return proc


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the daemon's session (unshare and the daemon), SIGKILL if it lingers."""
    for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


@needs_namespaces
def test_container_daemon_shares_only_the_runtime_dir(runtime_dir: Path) -> None:
    """A daemon with its own /tmp and /dev/shm serves the ranks: they share its runtime directory (sockets,
    secret, pid file), their uid and PID namespace; shared memory travels as memfds over the op socket."""
    job = new_job()
    proc = _contained_daemon(_own_mounts(runtime_dir), job)
    try:
        assert _one_rank(job) == 2.5
    finally:
        _stop(proc)


@needs_namespaces
def test_container_daemon_in_another_pid_namespace_is_refused(runtime_dir: Path) -> None:
    """Ranks check that the process listening on the op socket is the daemon the job's files name: from
    another PID namespace the pids differ, and the rank refuses the daemon with both pids named."""
    job = new_job()
    proc = _contained_daemon(["unshare", "--pid", "--fork", "--mount-proc"], job)
    try:
        with pytest.raises(UntrustedDaemonError, match=r"is pid \d+, but .*daemon.pid names pid 1 as the job's daemon"):
            _one_rank(job)
    finally:
        _stop(proc)


# ---- MemoryDenyWriteExecute ----------------------------------------------------------------------
MDWE_EXEC = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(65, 1, 0, 0, 0) != 0:  # PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN
    sys.exit(77)
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""


def test_daemon_works_without_writable_executable_memory(runtime_dir: Path) -> None:
    """The unit sets MemoryDenyWriteExecute=yes: the daemon's kernels must not need W+X memory."""
    job = new_job()
    proc = subprocess.Popen([sys.executable, "-c", MDWE_EXEC, "-m", "commd", "daemon", "--job", job],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        paths = JobPaths.for_job(job)
        wait_until(lambda: paths.secret_file.exists() or proc.poll() is not None, 90, "the daemon to serve")
        if proc.poll() == 77:
            pytest.skip("this kernel has no PR_SET_MDWE")
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        client = Client(0, 1, job=job)
        client.register_group("world", [0])
        rng = np.random.default_rng(1)
        for dtype, op, n in ((np.float32, "sum", 8 << 20), (np.float64, "max", 1000), (np.int64, "sum", 3)):
            data = rng.integers(-50, 50, n).astype(dtype)
            t = torch.from_numpy(data.copy())
            ops.all_reduce(client, t, op).wait(60)
            assert np.array_equal(t.numpy(), data)  # one rank: the reduction of one buffer is itself
        b = torch.full((4096,), 1.5, dtype=torch.bfloat16)
        ops.all_reduce(client, b).wait(60)
        assert torch.all(b == 1.5)
        client.close()
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(30)


# ---- systemd unit --------------------------------------------------------------------------------
def _unit_with_dropin(directory: Path) -> Path:
    """The template as shipped, and beside it the example drop-in of instance commd@job.service with its
    ExecStart lines switched on and pointed at this environment's commd (as docs/deployment.md says)."""
    commd_bin = shutil.which("commd") or str(Path(sys.executable).with_name("commd"))
    shutil.copy(UNIT, directory / UNIT.name)
    example = USER_DROPIN.read_text()
    assert "[Service]" in example and "User=alice" in example
    assert "#ExecStart=\n" in example and "#ExecStart=/home/alice/venvs/train/bin/commd daemon" in example
    dropin = directory / "commd@job.service.d" / "user.conf"
    dropin.parent.mkdir()
    dropin.write_text(example.replace("#ExecStart=", "ExecStart=").replace("/home/alice/venvs/train/bin/commd",
                                                                          commd_bin))
    return directory / "commd@job.service"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_unit_verifies_and_is_well_sandboxed(tmp_path: Path) -> None:
    unit = _unit_with_dropin(tmp_path)
    verify = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], cwd="/",
                            capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0 and "commd@" not in verify.stdout + verify.stderr, verify.stderr
    shipped = UNIT.read_text()
    for needed in ("Type=notify", "NotifyAccess=main", "ProtectSystem=strict", "MemoryDenyWriteExecute=yes"):
        assert needed in shipped
    for forbidden in ("PrivateDevices=yes", "PrivateIPC=yes", "RemoveIPC=yes", "PrivateTmp=yes", "PrivateNetwork=yes"):
        assert forbidden not in shipped, f"{forbidden} would cut the daemon off its workers or peers"
    security = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(unit)], cwd="/",
                              capture_output=True, text=True, timeout=60)
    score = re.search(r"Overall exposure level for commd@job.service: ([0-9.]+)", security.stdout)
    assert score, security.stdout + security.stderr
    assert float(score.group(1)) <= 2.5, security.stdout


# ---- Slurm: the prolog and epilog as slurmd runs them ----------------------------------------------
def _slurm_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the Slurm prolog tests run as root, like slurmd"
    for tool in ("setpriv", "unshare", "sha256sum", "env"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    try:
        pwd.getpwnam(JOB_USER)
    except KeyError:
        return f"no user {JOB_USER!r}"
    return None


needs_slurm_env = pytest.mark.skipif(_slurm_unavailable() is not None, reason=str(_slurm_unavailable()))

# A node's view: its own host name (optional) and, for each directory on the way to this checkout's
# Python that the job user cannot enter (/root; a checkout cloned into a 0700 directory), a private
# mount namespace in which that directory is an empty 0755 tmpfs holding only the entries on those
# paths, bound back unchanged: the job user runs the same interpreter, packages and checkout from
# the same paths, as on a cluster node where the job environment is installed where it can reach it.
# Arguments: HOST, the number of closed directories, then per directory: DIR, N, its N entries to keep.
NODE_VIEW = r"""
set -e
host=$1 groups=$2
shift 2
if [ -n "$host" ]; then hostname "$host"; fi
while [ "$groups" -gt 0 ]; do
    hidden=$1 n=$2
    shift 2
    keeps=() temps=()
    for ((i = 0; i < n; i++)); do
        if [ -d "$1" ]; then t=$(mktemp -d); else t=$(mktemp); fi
        mount --bind "$1" "$t"
        keeps+=("$1") temps+=("$t")
        shift
    done
    mount -t tmpfs -o mode=0755 tmpfs "$hidden"
    for i in "${!keeps[@]}"; do
        if [ -d "${temps[$i]}" ]; then mkdir "${keeps[$i]}"; else touch "${keeps[$i]}"; fi
        mount --move "${temps[$i]}" "${keeps[$i]}"
        rm -d "${temps[$i]}"
    done
    groups=$((groups - 1))
done
exec "$@"
"""


def _job_user_paths() -> list[Path]:
    """What the job's processes run: this interpreter (as named and its real file), its prefixes and
    package directories, and this checkout (the tests' PYTHONPATH, the Slurm scripts, the worker)."""
    named = [Path(sys.executable), Path(os.path.realpath(sys.executable)), Path(sys.prefix), Path(sys.base_prefix),
             REPO, *(Path(p) for p in sys.path if p and os.path.isdir(p))]
    paths: list[Path] = []
    for path in named:
        for variant in (Path(os.path.realpath(path.parent)) / path.name, Path(os.path.realpath(path))):
            if variant not in paths:
                paths.append(variant)
    return paths


def _enters(st: os.stat_result, uid: int, gids: set[int]) -> bool:
    """Whether a user (uid, groups) may search a directory of this owner and mode (never root here)."""
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid in gids:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


@functools.cache
def _closed_dirs() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The directories on the job user's paths it cannot enter, outermost first, each with its
    entries on those paths (what the node view keeps)."""
    user = pwd.getpwnam(JOB_USER)
    gids = {user.pw_gid, *os.getgrouplist(JOB_USER, user.pw_gid)}
    closed: dict[Path, list[str]] = {}
    for path in _job_user_paths():
        for parent in reversed(path.parents):
            if parent == Path("/") or not parent.is_dir() or _enters(parent.stat(), user.pw_uid, gids):
                continue
            keep = str(parent / path.relative_to(parent).parts[0])
            if keep not in closed.setdefault(parent, []):
                closed[parent].append(keep)
    return tuple((str(d), tuple(keeps)) for d, keeps in sorted(closed.items(), key=lambda kv: len(kv[0].parts)))


def node_view(cmd: list[str], host: str | None = None) -> list[str]:
    flags = ["--mount", "--propagation", "private"] + (["--uts"] if host else [])
    spec = [str(len(_closed_dirs()))]
    for hidden, keeps in _closed_dirs():
        spec += [hidden, str(len(keeps)), *keeps]
    return ["unshare", *flags, "bash", "-c", NODE_VIEW, "bash", host or "", *spec, *cmd]


@functools.cache
def _job_user_cannot_run_python() -> str | None:
    """Why the job user cannot run this checkout's Python even in a node view (the Slurm tests then
    skip with it), or None.  Checked once, before the first Slurm test."""
    user = pwd.getpwnam(JOB_USER)
    probe = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups", "env", "-i",
             f"PYTHONPATH={REPO}", sys.executable, "-c", "import commd.client, torch"]
    try:
        done = subprocess.run(node_view(probe), capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return f"the job user {JOB_USER} could not import commd within 120 s"
    if done.returncode == 0:
        return None
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    hidden = ", ".join(d for d, _ in _closed_dirs()) or "none"
    return (f"the job user {JOB_USER} (uid {user.pw_uid}) cannot run {sys.executable} -c 'import commd.client, "
            f"torch' with PYTHONPATH={REPO}, even in the tests' node view (closed directories bound around: "
            f"{hidden}): {last}. The job user needs execute permission on the interpreter, its real file "
            f"{os.path.realpath(sys.executable)}, and every directory above them and above the checkout")


@dataclass
class SlurmSite:
    """A site set-up: the job environment's commd, per-node configs, runtime roots, a site secret."""

    base: Path
    uid: int
    gid: int

    @property
    def commd_bin(self) -> Path:
        return self.base / "env" / "bin" / "commd"

    def conf(self, node: str, **settings: str) -> Path:
        values = {"COMMD_BIN": str(self.commd_bin), "LOG_FILE": str(self.base / f"{node}.log"),
                  "RUNTIME_DIR": str(self.base / "rt" / node / "commd-%u"),
                  "SITE_SECRET_FILE": str(self.base / "site-secret"), "RENDEZVOUS_TIMEOUT": "60",
                  "STOP_TIMEOUT": "20"}
        values.update(settings)
        node_tmp = self.base / "rt" / node  # this node's /tmp
        node_tmp.mkdir(exist_ok=True)
        node_tmp.chmod(0o1777)
        path = self.base / f"{node}.conf"
        path.write_text("# test site\n" + "".join(f"{k}={v}\n" for k, v in values.items()))
        path.chmod(0o644)
        return path

    def job_dir(self, node: str, job_id: str) -> Path:
        return self.base / "rt" / node / f"commd-{self.uid}" / f"slurm-{job_id}"

    def log(self, node: str) -> str:
        try:
            return (self.base / f"{node}.log").read_text()
        except FileNotFoundError:
            return ""

    def slurm_env(self, conf: Path, job_id: str, nodelist: str, user: tuple[str, int] | None = None) -> list[str]:
        """slurmd's environment for Prolog/Epilog: nothing else (no PATH).  ``user``: (name, uid) of
        another job user than the site's."""
        name, uid = user or (JOB_USER, self.uid)
        return ["env", "-i", f"COMMD_SLURM_CONF={conf}", f"SLURM_JOB_ID={job_id}", f"SLURM_JOB_UID={uid}",
                f"SLURM_JOB_USER={name}", f"SLURM_JOB_NODELIST={nodelist}"]

    def script(self, which: str, conf: Path, job_id: str, nodelist: str, host: str | None = None,
               wrap: list[str] | None = None,
               user: tuple[str, int] | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
        cmd = node_view([*self.slurm_env(conf, job_id, nodelist, user), str(SLURM_DIR / f"{which}.sh")], host)
        started = time.monotonic()
        done = subprocess.run([*(wrap or []), *cmd], capture_output=True, text=True, timeout=150)
        return done, time.monotonic() - started

    def as_job_user(self, cmd: list[str], env: dict[str, str]) -> list[str]:
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups",
                "env", "-i", *[f"{k}={v}" for k, v in env.items()], *cmd]

    def task_env(self, conf: Path, job_id: str, host: str | None = None,
                 wrap: list[str] | None = None) -> dict[str, str]:
        """Run the TaskProlog as the job user; its `export` lines are the ranks' environment."""
        cmd = node_view(self.as_job_user([str(SLURM_DIR / "task-prolog.sh")],
                                         {"COMMD_SLURM_CONF": str(conf), "SLURM_JOB_ID": job_id}), host)
        out = subprocess.run([*(wrap or []), *cmd], capture_output=True, text=True, timeout=60, check=True).stdout
        env = dict(re.findall(r"^export (\w+)=(\S+)$", out, re.M))
        assert set(env) == {"COMMD_JOB", "COMMD_RUNTIME_DIR", "COMMD_NODE"}, out
        return env

    def start_ranks(self, env: dict[str, str], ranks: list[tuple[int, list[str] | None]], world: int,
                    host: str | None = None, wrap: list[str] | None = None,
                    connect_timeout: float = 120) -> list[subprocess.Popen[str]]:
        """The job's ranks on one node, as the job user (they may start before the daemon serves)."""
        full = {"PYTHONPATH": str(REPO), "WORKER_CONNECT_TIMEOUT": str(connect_timeout), **env}
        procs = []
        for rank, nodes in ranks:
            argv = [sys.executable, str(WORKER), str(rank), str(world)] + ([",".join(nodes)] if nodes else [])
            cmd = node_view(self.as_job_user(argv, full), host)
            procs.append(subprocess.Popen([*(wrap or []), *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, start_new_session=True))
        return procs


def rank_results(procs: list[subprocess.Popen[str]], timeout: float = 200) -> list[dict]:
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"a rank did not finish within {timeout}s: {out} {err}")
        lines = [line for line in out.splitlines() if line.startswith("{")]
        assert lines, f"rank printed no result (exit {proc.returncode}): {out} {err}"
        results.append(json.loads(lines[-1]))
    return results


def _job_pids(job: str) -> list[int]:
    """The commd processes of this job (by their command line)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if f"--job {job} " in cmdline + " " and "commd" in cmdline:
                pids.append(int(entry.name))
    return pids


def _kill_job_processes(job: str) -> None:
    """Safety net: end what a failed test left of this job (the epilog normally does)."""
    for pid in _job_pids(job):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def slurm_site() -> Iterator[SlurmSite]:
    reason = _slurm_unavailable() or _job_user_cannot_run_python()
    if reason:
        pytest.skip(reason)
    user = pwd.getpwnam(JOB_USER)
    base = Path(tempfile.mkdtemp(prefix="commd-slurm-", dir="/tmp"))
    base.chmod(0o755)
    site = SlurmSite(base, user.pw_uid, user.pw_gid)
    (base / "rt").mkdir(mode=0o755)
    site.commd_bin.parent.mkdir(parents=True)
    # "The job environment's commd": this checkout, whatever the caller's PYTHONPATH (env -i clears it).
    site.commd_bin.write_text(f"#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m commd \"$@\"\n")
    site.commd_bin.chmod(0o755)
    secret = base / "site-secret"
    secret.write_text(os.urandom(32).hex() + "\n")
    secret.chmod(0o600)
    yield site
    for job_dir in (base / "rt").glob("*/commd-*/slurm-*"):
        _kill_job_processes(job_dir.name)
    shutil.rmtree(base, ignore_errors=True)


def _job_id() -> str:
    return str(random.randrange(100_000, 999_999))


def _daemon_pid(job_dir: Path) -> int | None:
    try:
        pid = int((job_dir / "daemon.pid").read_text())
    except (OSError, ValueError):
        return None
    return pid if pid_alive(pid) else None


def _uid_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^Uid:\s+(\d+)", status, re.M).group(1))


@needs_slurm_env
def test_slurm_one_node(slurm_site: SlurmSite) -> None:
    """Prolog starts the job user's daemon and returns; two ranks all_reduce through it; epilog stops it."""
    site, job_id = slurm_site, _job_id()
    node = socket.gethostname().split(".")[0]
    conf = site.conf(node)
    done, elapsed = site.script("prolog", conf, job_id, node)
    assert done.returncode == 0, done.stderr
    assert "started the daemon of job slurm-" in done.stderr and elapsed < 90
    env = site.task_env(conf, job_id)
    assert env["COMMD_JOB"] == f"slurm-{job_id}" and env["COMMD_NODE"] == node
    job_dir = site.job_dir(node, job_id)
    assert env["COMMD_RUNTIME_DIR"] == str(job_dir.parent)
    results = rank_results(site.start_ranks(env, [(0, None), (1, None)], 2))
    assert results == [{"ok": True, "sum": [3.0, 3.0], "uid": site.uid}] * 2, results
    pid = _daemon_pid(job_dir)
    assert pid is not None and _uid_of(pid) == site.uid, "the daemon must run as the job user"
    assert job_dir.stat().st_uid == site.uid and stat.S_IMODE(job_dir.stat().st_mode) == 0o700
    done, _ = site.script("epilog", conf, job_id, node)
    assert done.returncode == 0, done.stderr
    wait_until(lambda: not pid_alive(pid), 30, "the daemon to stop")
    assert not job_dir.exists(), "the epilog must remove the job's runtime directory"
    assert f"started the daemon of job slurm-{job_id}" in site.log(node)


@needs_slurm_env
@pytest.mark.parametrize("case", ["missing-bin", "bad-nodelist", "daemon-fails", "bad-config"])
def test_slurm_prolog_failure_reaches_the_job(slurm_site: SlurmSite, case: str) -> None:
    """A job-side problem: the prolog exits 0 (the node is not drained), logs, and the ranks fail with it."""
    site, job_id = slurm_site, _job_id()
    node = socket.gethostname().split(".")[0]
    nodelist, settings = node, {}
    if case == "missing-bin":
        settings, expect = {"COMMD_BIN": "/nonexistent/bin/commd"}, "COMMD_BIN=/nonexistent/bin/commd is not an executable"
    elif case == "bad-nodelist":
        nodelist, expect = "othernode[1-2]", f"this node '{node}' is not in the job's node list"
    elif case == "daemon-fails":
        broken = site.base / "env" / "bin" / "commd-broken"
        broken.write_text(f'#!/bin/sh\n[ "$1" = daemon ] && export COMMD_OP_TIMEOUT=bogus\nexec {site.commd_bin} "$@"\n')
        broken.chmod(0o755)
        settings, expect = {"COMMD_BIN": str(broken)}, "COMMD_OP_TIMEOUT='bogus' is not a number"
    else:
        settings, expect = {"FAVOURITE_COLOUR": "blue"}, "unknown setting FAVOURITE_COLOUR"
    conf = site.conf(node, **settings)
    done, elapsed = site.script("prolog", conf, job_id, nodelist)
    assert done.returncode == 0, done.stderr
    assert elapsed < 90
    env = site.task_env(conf, job_id)
    [result] = rank_results(site.start_ranks(env, [(0, None)], 1, connect_timeout=90))
    assert not result["ok"]
    assert "ConnectError" in result["error"] and "could not be started" in result["error"], result
    assert expect in result["error"], result
    if case != "daemon-fails":
        assert expect in site.log(node), site.log(node)
    done, _ = site.script("epilog", conf, job_id, nodelist)
    assert done.returncode == 0, done.stderr
    assert not site.job_dir(node, job_id).exists()


def _private_dir(site: SlurmSite) -> Path:
    """A directory of root's that the job user cannot enter (like a checkout in a 0700 home)."""
    private = site.base / "private"
    private.mkdir(mode=0o700)
    private.chmod(0o700)
    return private


@needs_slurm_env
@pytest.mark.parametrize("case", ["closed-bin-dir", "closed-interpreter", "closed-wrapped", "not-executable"])
def test_slurm_prolog_refuses_what_the_job_user_cannot_execute(slurm_site: SlurmSite, case: str) -> None:
    """COMMD_BIN, or the interpreter it runs, behind a directory the job user cannot enter (or not
    executable for it): the prolog names what is closed, in the log and to the job, and starts nothing."""
    site, job_id = slurm_site, _job_id()
    node = socket.gethostname().split(".")[0]
    private = _private_dir(site)
    launcher = f'#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m commd "$@"\n'
    closed = f"user {JOB_USER} cannot enter the directory {private} (owner root, mode 700)"
    if case == "closed-bin-dir":
        (bin_path := private / "commd").write_text(launcher)
        expect = f"COMMD_BIN={bin_path} is not an executable file for user {JOB_USER}: {closed}"
    elif case == "closed-interpreter":
        (private / "python").symlink_to(os.path.realpath(sys.executable))
        bin_path = site.base / "env" / "bin" / "commd-closed"
        bin_path.write_text(f"#!{private}/python\nfrom commd.cli.main import main\nmain()\n")
        expect = (f"the interpreter {private}/python that COMMD_BIN={bin_path} names is not an executable file "
                  f"for user {JOB_USER}: {closed}")
    elif case == "closed-wrapped":  # what the prolog can only learn by running it: a wrapper's exec fails
        (private / "python").symlink_to(os.path.realpath(sys.executable))
        bin_path = site.base / "env" / "bin" / "commd-wrapped"
        bin_path.write_text(f'#!/bin/sh\nPYTHONPATH={REPO} exec {private}/python -m commd "$@"\n')
        expect = f"user {JOB_USER} cannot run COMMD_BIN={bin_path} (exit 126): "
    else:
        bin_path = site.base / "env" / "bin" / "commd-0644"
        bin_path.write_text(launcher)
        bin_path.chmod(0o644)
        expect = f"COMMD_BIN={bin_path} is not an executable file for user {JOB_USER}: user {JOB_USER} may not " \
                 "execute it (owner root, mode 644)"
    if case != "not-executable":
        bin_path.chmod(0o755)
    conf = site.conf(node, COMMD_BIN=str(bin_path))
    done, _ = site.script("prolog", conf, job_id, node)
    assert done.returncode == 0, done.stderr
    needs = "the job user needs execute permission on COMMD_BIN, on the interpreter it runs and on every directory"
    for where in (done.stderr, site.log(node)):
        assert expect in where and needs in where, where
    job_dir = site.job_dir(node, job_id)
    assert expect in (job_dir / "start.error").read_text()  # what the job's ranks report (see above)
    assert _daemon_pid(job_dir) is None and not (job_dir / "starting").exists()
    done, _ = site.script("epilog", conf, job_id, node)
    assert done.returncode == 0, done.stderr
    assert not job_dir.exists()


@needs_slurm_env
def test_slurm_prolog_refuses_a_root_job(slurm_site: SlurmSite) -> None:
    """A job of root gets no daemon: the prolog logs the refusal, exits 0 (the node stays up) and
    creates nothing; the epilog has nothing to do."""
    site, job_id = slurm_site, _job_id()
    node = socket.gethostname().split(".")[0]
    conf = site.conf(node)
    done, _ = site.script("prolog", conf, job_id, node, user=("root", 0))
    assert done.returncode == 0, done.stderr
    refusal = "refusing to run a commd daemon as root (job user 'root')"
    assert refusal in done.stderr and refusal in site.log(node), done.stderr
    assert "started the daemon" not in site.log(node)
    assert not (site.base / "rt" / node / "commd-0").exists()
    assert not _job_pids(f"slurm-{job_id}")
    done, _ = site.script("epilog", conf, job_id, node, user=("root", 0))
    assert done.returncode == 0, done.stderr


def _netns_hosts(hosts: object, names: list[str]) -> Iterator[None]:
    """Name resolution per simulated host (`ip netns exec` bind-mounts /etc/netns/<ns>/hosts)."""
    lines = "127.0.0.1 localhost\n" + "".join(f"{h.ip} {n}\n" for h, n in zip(hosts, names, strict=True))
    made = []
    for host in hosts:
        directory = Path("/etc/netns") / host.netns
        directory.mkdir(parents=True, exist_ok=False)
        made.append(directory)
        (directory / "hosts").write_text(lines)
    try:
        yield
    finally:
        for directory in made:
            shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def two_slurm_nodes(sim_hosts, slurm_site: SlurmSite) -> Iterator[tuple[SlurmSite, list, list[str]]]:
    hosts = sim_hosts(2)
    names = [f"cn{hosts.tag}{i}" for i in range(2)]
    resolver = _netns_hosts(list(hosts), names)
    next(resolver)
    try:
        yield slurm_site, list(hosts), names
    finally:
        next(resolver, None)


def _ns(host: object) -> list[str]:
    return ["ip", "netns", "exec", host.netns]


@needs_slurm_env
@pytest.mark.timeout(400)
@pytest.mark.extended
def test_slurm_two_hosts(two_slurm_nodes: tuple[SlurmSite, list, list[str]]) -> None:
    """Two nodes: each prolog returns without waiting for the other; the daemons form a fabric with the
    job secret derived from the site secret; a rank per node all_reduces across them; epilogs stop both."""
    site, hosts, names = two_slurm_nodes
    job_id = _job_id()
    nodelist = f"{names[0][:-1]}[0-1]"
    assert expand_hostlist(nodelist) == names
    confs = [site.conf(name) for name in names]
    for i in range(2):
        done, elapsed = site.script("prolog", confs[i], job_id, nodelist, names[i], wrap=_ns(hosts[i]))
        assert done.returncode == 0 and f"rank {i} of 2" in done.stderr, done.stderr
        assert elapsed < 90
    envs = [site.task_env(confs[i], job_id, names[i], wrap=_ns(hosts[i])) for i in range(2)]
    procs = [p for i in range(2) for p in site.start_ranks(envs[i], [(i, names)], 2, names[i], wrap=_ns(hosts[i]))]
    results = rank_results(procs)
    assert results == [{"ok": True, "sum": [3.0, 3.0], "uid": site.uid}] * 2, results
    site_key = (site.base / "site-secret").read_text().strip()
    pids = []
    for name in names:
        job_dir = site.job_dir(name, job_id)
        assert (job_dir / "secret").read_text().strip() == job_secret(site_key, job_id)
        pid = _daemon_pid(job_dir)
        assert pid is not None and _uid_of(pid) == site.uid
        pids.append(pid)
    for i in range(2):
        done, _ = site.script("epilog", confs[i], job_id, nodelist, names[i], wrap=_ns(hosts[i]))
        assert done.returncode == 0, done.stderr
    for pid in pids:
        wait_until(lambda pid=pid: not pid_alive(pid), 30, f"daemon {pid} to stop")
    assert not any(site.job_dir(name, job_id).exists() for name in names)


@needs_slurm_env
@pytest.mark.slow  # 20 s (node 0 waits out its rendezvous timeout): make test-all
@pytest.mark.timeout(400)
def test_slurm_two_hosts_one_node_fails(two_slurm_nodes: tuple[SlurmSite, list, list[str]]) -> None:
    """Node 1's prolog cannot start commd: node 0's prolog still returns at once with 0, and the ranks
    of both nodes fail with the reason (node 1: its own; node 0: its daemon gave up on node 1)."""
    site, hosts, names = two_slurm_nodes
    job_id = _job_id()
    nodelist = ",".join(names)
    confs = [site.conf(names[0], RENDEZVOUS_TIMEOUT="15"),
             site.conf(names[1], COMMD_BIN="/nonexistent/bin/commd")]
    done, elapsed = site.script("prolog", confs[0], job_id, nodelist, names[0], wrap=_ns(hosts[0]))
    assert done.returncode == 0, done.stderr
    job_dir0 = site.job_dir(names[0], job_id)
    # Returned while its daemon still waits for node 1: the prolog never waits on other nodes.
    assert (job_dir0 / "starting").exists() and not (job_dir0 / "secret").exists()
    done, _ = site.script("prolog", confs[1], job_id, nodelist, names[1], wrap=_ns(hosts[1]))
    assert done.returncode == 0, done.stderr
    envs = [site.task_env(confs[i], job_id, names[i], wrap=_ns(hosts[i])) for i in range(2)]
    procs = [p for i in range(2) for p in site.start_ranks(envs[i], [(i, names)], 2, names[i], wrap=_ns(hosts[i]))]
    node0, node1 = rank_results(procs)
    assert not node1["ok"] and "COMMD_BIN=/nonexistent/bin/commd is not an executable" in node1["error"], node1
    assert names[1] in node1["error"]
    assert not node0["ok"] and "could not be started" in node0["error"], node0
    assert "exited with code 1: cannot form the fabric" in node0["error"], node0
    for i in range(2):
        done, _ = site.script("epilog", confs[i], job_id, nodelist, names[i], wrap=_ns(hosts[i]))
        assert done.returncode == 0, done.stderr
    assert not any(site.job_dir(name, job_id).exists() for name in names)
