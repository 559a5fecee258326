"""Shared memory cannot kill anyone: full /dev/shm, shrunk segments, too many segments, arena settings.

The daemon maps memory its clients made, so memory is where one process can
take the whole node's job down: a sparse segment in a full /dev/shm (SIGBUS on
first touch), a client shrinking its segment under the daemon (SIGBUS in the
daemon), a client registering segments without end (the daemon runs out of
mappings or descriptors).  Each case ends in a clear error or a correct result,
with every process alive and the daemon serving the others.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import DaemonProcess, wait_until

from commd.client import ConnectError, RequestError, ops
from commd.memory.arena import Segment, SegmentError
from commd.memory.budget import Budget, default_arena_bytes
from commd.runtime import ConfigError, pid_alive

pytestmark = pytest.mark.timeout(240)

HERE = Path(__file__).parent


def check_all_reduce(clients: list[Any], what: str, group: str = "world", n: int = 1000) -> None:
    """A float32 all-reduce among ``clients`` (the whole of ``group``), compared with NumPy."""
    inputs = [np.arange(n, dtype=np.float32) * (r + 1) for r in range(len(clients))]
    tensors = [torch.from_numpy(x.copy()) for x in inputs]
    handles = [ops.all_reduce(c, t, group=group, timeout=20) for c, t in zip(clients, tensors, strict=True)]
    for h in handles:
        h.wait(30)
    want = np.sum(inputs, axis=0)
    for rank, t in enumerate(tensors):
        assert np.array_equal(t.numpy(), want), f"{what}: rank {rank} got a wrong all-reduce result"


# ---- (a) a 64 MiB /dev/shm ----------------------------------------------------
def test_small_dev_shm_kills_no_process(runtime_dir: Path, job: str, tmp_path: Path) -> None:
    """Under a container-sized /dev/shm a 40 MiB all-reduce and a staged all-gather succeed or fail clearly."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare(1) for a private mount namespace")
    probe = subprocess.run([unshare, "-m", "sh", "-c", "mount -t tmpfs -o size=64m tmpfs /dev/shm"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private 64 MiB /dev/shm (needs root): {probe.stderr.strip()}")
    result_path = tmp_path / "result.json"
    command = (f"mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {sys.executable} {HERE / 'shm_small_program.py'} "
               f"--runtime-dir {runtime_dir} --job {job} --result {result_path}")
    run = subprocess.run([unshare, "-m", "sh", "-c", command], capture_output=True, text=True, timeout=200)
    assert run.returncode == 0 and result_path.exists(), f"the program failed ({run.returncode}):\n{run.stderr}"
    result = json.loads(result_path.read_text())
    log = result["daemon_log"]
    assert result["shm"] == 64 << 20, f"/dev/shm was not the 64 MiB tmpfs: {result['shm']} bytes"
    assert "error" not in result, f"{result['error']}\n{log}"
    problems = []
    for rank, rank_result in sorted(result["ranks"].items()):
        rc, output = rank_result["rc"], rank_result["output"]
        if rc != 0:
            problems.append(f"rank {rank} exited with {rc}" + (f" ({signal.Signals(-rc).name})" if rc < 0 else "")
                            + f":\n{output}")
            continue
        report = json.loads(output.strip().splitlines()[-1])
        if "error" in report:  # a clear failure is acceptable: it must name the memory it lacked
            if "shared memory" not in report["error"]:
                problems.append(f"rank {rank} failed without naming the memory: {report['error']}")
        elif not (report.get("allreduce_ok") and report.get("allgather_ok")):
            problems.append(f"rank {rank} got wrong results: {report}")
    if not result["daemon_alive"]:
        problems.append(f"the daemon died (exit code {result['daemon_rc']})")
    elif result["daemon_rc"] != 0:
        problems.append(f"the daemon did not stop cleanly on SIGTERM (exit code {result['daemon_rc']})")
    assert not problems, "\n".join(problems) + f"\n--- daemon.log ---\n{log}"


def test_fatal_signal_in_the_daemon_is_logged(start_daemon: Callable[..., DaemonProcess]) -> None:
    """A daemon killed by SIGBUS (or any fatal signal) leaves the signal and its stacks in its log."""
    daemon = start_daemon().wait_ready()
    os.kill(daemon.pid, signal.SIGBUS)
    daemon.proc.wait(timeout=30)
    log = daemon.log_tail(200)
    assert "Bus error" in log, f"no trace of the SIGBUS in the daemon's log:\n{log}"
    assert "most recent call first" in log, f"the log has no stack of the dying daemon:\n{log}"


def test_segment_larger_than_free_memory_is_a_clear_error() -> None:
    """Asking for more than is free fails at creation, naming the source, the request and what is free."""
    with pytest.raises(SegmentError) as caught:
        Segment.create(0, "commd-too-big", 1 << 50)
    text = str(caught.value)
    assert "shared memory" in text and "1048576.0 GiB" in text and "free" in text, text


def test_segment_pages_are_reserved_at_creation() -> None:
    """Every page is allocated up front: nothing is left to fault in (and fail) later."""
    segment = Segment.create(0, "commd-reserved", 4 << 20)
    try:
        blocks = os.fstat(segment.fd).st_blocks * 512
        assert blocks >= 4 << 20, f"only {blocks} of {4 << 20} bytes are allocated"
    finally:
        segment.close_fd()


def test_default_arena_is_a_fair_share_of_what_is_free() -> None:
    assert default_arena_bytes(Budget(1 << 40, "test")) == 64 << 20
    assert default_arena_bytes(Budget(80 << 20, "test")) == 10 << 20
    assert default_arena_bytes(Budget(0, "test")) == 1 << 16


# ---- (b) a client shrinks its registered segment --------------------------------
def test_shrunk_segment_cannot_kill_the_daemon(daemon: DaemonProcess, connect: Callable[..., Any]) -> None:
    """Shrinking a registered segment is refused (or its op fails); the daemon keeps serving the others."""
    victim, peer, bystander = (connect(r, 3) for r in range(3))
    for client in (victim, peer):
        client.register_group("pair", [0, 1])
    for client in (peer, bystander):
        client.register_group("others", [1, 2])
    n = 1 << 20  # 4 MiB of float32 in each arena
    mine, theirs = victim.empty(n, torch.float32), peer.empty(n, torch.float32)
    mine.copy_(torch.arange(n, dtype=torch.float32))
    theirs.fill_(1.0)
    segment = victim.arena.segments[0]
    # The file behind the mapping, reachable again by its owner however it was created.
    path = f"/proc/self/map_files/{segment.base:x}-{segment.base + segment.size:x}"
    try:
        fd = os.open(path, os.O_RDWR)
    except PermissionError:
        pytest.skip(f"cannot open {path} (needs CAP_SYS_ADMIN)")
    try:
        os.ftruncate(fd, 4096)
        shrunk = True
    except PermissionError:  # sealed against shrinking: the kernel refuses
        shrunk = False
    finally:
        os.close(fd)
    handles = [ops.all_reduce(c, t, group="pair", timeout=20) for c, t in ((victim, mine), (peer, theirs))]
    outcomes: list[Exception | None] = []
    for h in handles:
        try:
            h.wait(30)
            outcomes.append(None)
        except Exception as exc:  # an error is an acceptable answer; a dead daemon is not
            outcomes.append(exc)
    assert pid_alive(daemon.pid), f"the daemon died after a client shrank its segment (outcomes: {outcomes})"
    if not shrunk:  # nothing changed under anyone: the op must simply be right
        assert outcomes == [None, None], outcomes
        want = np.arange(n, dtype=np.float32) + 1
        assert np.array_equal(mine.numpy(), want) and np.array_equal(theirs.numpy(), want)
    check_all_reduce([peer, bystander], "after a client tried to shrink its segment", group="others")


# ---- (c) caps on a client's segments ------------------------------------------
def fill_arena(client: Any, tensor_bytes: int, attempts: int) -> tuple[list[torch.Tensor], Exception | None]:
    """Allocate tensors that each need a fresh segment until the daemon refuses one (or ``attempts``)."""
    kept = []
    for _ in range(attempts):
        try:
            kept.append(client.empty(tensor_bytes // 4, torch.float32))
        except Exception as exc:
            return kept, exc
    return kept, None


@pytest.mark.parametrize("cap_env, cap, tensor_bytes, words", [
    ("COMMD_MAX_SEGMENTS", "8", 1 << 16, ("COMMD_MAX_SEGMENTS=8", "8 segments")),
    ("COMMD_MAX_ARENA_BYTES", "1M", 1 << 18, ("COMMD_MAX_ARENA_BYTES", "1048576 bytes")),
])
def test_segment_caps(start_daemon: Callable[..., DaemonProcess], connect: Callable[..., Any],
                      monkeypatch: pytest.MonkeyPatch, cap_env: str, cap: str, tensor_bytes: int,
                      words: tuple[str, ...]) -> None:
    """Past a cap a client gets a clear error, keeps its arena, and other clients still connect and run."""
    monkeypatch.setenv(cap_env, cap)
    start_daemon().wait_ready()
    greedy = connect(0, 2, arena_bytes=tensor_bytes)
    kept, error = fill_arena(greedy, tensor_bytes, 40)
    assert isinstance(error, RequestError), f"{len(kept)} segments registered without an error (got {error!r})"
    assert all(w in str(error) for w in words), f"the error does not name the cap: {error}"
    assert len(greedy.arena.segments) == len(kept), "a refused segment stayed in the arena"
    other = connect(1, 2, arena_bytes=1 << 16)
    check_all_reduce([greedy, other], "after the cap was reached")


# ---- (d) COMMD_ARENA_BYTES ----------------------------------------------------
def test_arena_bytes_accepts_units(daemon: DaemonProcess, connect: Callable[..., Any],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMMD_ARENA_BYTES", "1M")
    client = connect(0, 1)
    assert client.arena.total_bytes() == 1 << 20
    check_all_reduce([client], "with a 1M arena")


@pytest.mark.parametrize("value", ["garbage", "12XB", "-1M", "3"])
def test_bad_arena_bytes_fails_before_anything_starts(runtime_dir: Path, job: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """Client and `commd launch` both refuse, naming the variable and the value, before any process starts."""
    from commd.client import Client

    monkeypatch.setenv("COMMD_ARENA_BYTES", value)
    with pytest.raises(ConfigError, match=f"COMMD_ARENA_BYTES='{value}'"):
        Client(0, 1, job=job, secret="0" * 64, connect_timeout=5)  # no daemon runs: the setting is checked first
    marker = tmp_path / "worker-ran"
    script = tmp_path / "worker.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    launch = subprocess.run([sys.executable, "-m", "commd", "launch", "--nproc-per-node", "1", "--job", job,
                             str(script)], capture_output=True, text=True, timeout=120)
    assert launch.returncode == 2, f"commd launch exited {launch.returncode}:\n{launch.stderr}"
    assert f"COMMD_ARENA_BYTES='{value}'" in launch.stderr, launch.stderr
    assert not marker.exists(), "the worker ran despite the invalid setting"
    assert not (runtime_dir / job / "daemon.pid").exists(), "a daemon was started despite the invalid setting"


def test_connect_error_is_not_masked_by_the_arena(runtime_dir: Path, job: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A valid setting with no daemon: the error is about the daemon, not the arena."""
    from commd.client import Client

    monkeypatch.setenv("COMMD_ARENA_BYTES", "64KiB")
    with pytest.raises(ConnectError, match="no commd daemon"):
        Client(0, 1, job=job, secret="0" * 64, connect_timeout=5)


def test_descriptors_sent_with_messages_are_never_kept(daemon: DaemonProcess) -> None:
    """Descriptors attached to refused messages, or too many at once, are closed: no client fills the table."""
    import array
    import socket

    from commd.protocol import schema as s

    def daemon_fds() -> int:
        return len(os.listdir(f"/proc/{daemon.pid}/fd"))

    spare = os.open("/dev/null", os.O_RDONLY)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:  # warm-up: lazily opened things
            sock.connect(str(daemon.paths.ops_socket))
            sock.send(s.encode({"t": s.SEGMENT, "secret": "0" * 64}))
            sock.recv(1 << 16)
        before = daemon_fds()
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.settimeout(10)
            sock.connect(str(daemon.paths.ops_socket))
            for count in (1, 1, 2, 4, 8) * 20:  # 320 descriptors sent
                frame = s.encode({"t": s.SEGMENT, "secret": "0" * 64, "client_id": 1, "seg": 0,
                                  "name": "commd-x", "size": 4096})
                sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [spare] * count))])
                reply = s.decode(sock.recv(1 << 16))
                assert reply["t"] == s.ERROR, reply
                want = "too many file descriptors" if count > 4 else "secret"
                assert want in reply["message"], f"{count} descriptors: {reply}"
    finally:
        os.close(spare)
    # Small slack: the daemon may open a file now and then (e.g. a client's /proc entry).
    wait_until(lambda: daemon_fds() <= before + 8, 10.0,
               f"the daemon to hold no more descriptors than before 100 refused messages ({before})")


def test_bad_arena_bytes_stops_the_torch_backend_before_a_daemon_starts(runtime_dir: Path, tmp_path: Path) -> None:
    """init_process_group("commd") with an invalid COMMD_ARENA_BYTES fails naming it, and starts no daemon."""
    code = (
        "import torch.distributed as dist, commd\n"
        f"store = dist.FileStore({str(tmp_path / 'store')!r}, 1)\n"
        "try:\n"
        "    dist.init_process_group('commd', store=store, rank=0, world_size=1)\n"
        "except Exception as exc:\n"
        "    print('refused:', exc)\n"
        "else:\n"
        "    print('accepted')\n"
    )
    env = dict(os.environ, COMMD_ARENA_BYTES="64 parsecs", COMMD_RUNTIME_DIR=str(runtime_dir))
    env.pop("COMMD_JOB", None)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert "refused:" in run.stdout and "COMMD_ARENA_BYTES='64 parsecs'" in run.stdout, run.stdout + run.stderr
    started = sorted(str(p) for p in runtime_dir.glob("*/daemon.log"))
    assert not started, f"a daemon was started despite the invalid setting: {started}"


def test_huge_page_memfd_is_refused() -> None:
    """A hugetlbfs page missing on a later fault is a SIGBUS: such segments are not accepted at all."""
    import fcntl

    try:
        fd = os.memfd_create("commd-huge", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB)
    except OSError as exc:
        pytest.skip(f"no huge-page memfds here: {exc}")
    try:
        os.ftruncate(fd, 2 << 20)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        with pytest.raises(ValueError, match="huge-page"):
            Segment.from_fd(0, "commd-huge", 4096, fd, os.getuid())
    finally:
        os.close(fd)
