"""The `commd` command line: launch, status and demo, run the way users run them.

launch and demo run as subprocesses (they start a daemon and workers, and a
hang must show up as a failed test, not a stuck run); status runs in process
against a daemon started here.  Each test has its own COMMD_RUNTIME_DIR.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from commd.cli import status as status_cli
from commd.cli.launch import stop_daemon
from commd.cli.main import main as commd_main
from commd.client import ops
from commd.client import status as status_client
from commd.client.connection import Client
from commd.client.spawn import start_daemon
from commd.runtime import JobPaths, free_port, new_secret, pid_alive

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"
#: Keys `commd status --json` documents (Daemon.status()).
STATUS_KEYS = {
    "job", "pid", "uptime_s", "closing", "clients", "groups", "ops_done", "bytes_moved",
    "latency_us", "oldest_waiting", "last_errors", "gc",
}
GROUP_KEYS = {"size", "next_seq", "waiting", "queued", "executing", "done", "failed", "bytes"}


@pytest.fixture
def rt(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private runtime root (short path: ipc socket paths are limited to ~107 bytes)."""
    path = tmp_path_factory.mktemp("clirt")
    monkeypatch.setenv("COMMD_RUNTIME_DIR", str(path))
    monkeypatch.delenv("COMMD_JOB", raising=False)
    monkeypatch.delenv("COMMD_SECRET", raising=False)
    return path


def _commd(args: list[str], timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run `python -m commd ARGS` with the test's environment, bounded in time."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "commd", *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=timeout, check=False,
    )


def _no_live_daemon(root: Path) -> bool:
    return status_client.live_jobs(root) == []


# ---- launch -------------------------------------------------------------------------
@pytest.mark.timeout(150)
def test_launch_two_workers_allreduce(rt: Path, tmp_path: Path) -> None:
    """Both workers get torchrun's environment, share the launcher's daemon, and sum correctly."""
    proc = _commd(["launch", "--nproc-per-node", "2", str(SCRIPTS / "cli_allreduce_worker.py"), str(tmp_path)],
                  timeout=120)
    assert proc.returncode == 0, proc.stderr
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(results):
        assert result["ok"], result
        assert result["sum"] == 3.0
        env = result["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == "0"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert 1 <= int(env["MASTER_PORT"]) <= 65535
        assert env["COMMD_SECRET"] is None  # never handed to workers through the environment
    assert results[0]["env"]["COMMD_JOB"] == results[1]["env"]["COMMD_JOB"]
    assert _no_live_daemon(rt)
    # A clean run under a generated job name leaves only the daemon's log behind.
    assert [p.name for p in (rt / results[0]["env"]["COMMD_JOB"]).iterdir()] == ["daemon.log"]


@pytest.mark.timeout(150)
def test_launch_propagates_failure_and_stops_peers(rt: Path, tmp_path: Path) -> None:
    """Rank 1 exits 7: the launcher exits 7, kills rank 0 (which would sleep 60s) and the daemon."""
    start = time.monotonic()
    proc = _commd(["launch", "--nproc-per-node", "2", "--grace", "3", "--job", "failing",
                   str(SCRIPTS / "cli_fail_worker.py"), str(tmp_path)], timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 7, proc.stderr
    assert "rank 1" in proc.stderr and "code 7" in proc.stderr
    assert elapsed < 50, f"launcher took {elapsed:.0f}s: rank 0 was not stopped promptly"
    for rank in range(2):
        pid = int((tmp_path / f"pid{rank}").read_text())
        assert not pid_alive(pid), f"rank {rank} (pid {pid}) outlived the launcher"
    assert _no_live_daemon(rt)
    assert (rt / "failing" / "daemon.log").exists()  # logs kept for the post-mortem


def test_launch_names_the_rank_that_failed_first_and_its_exception(rt: Path, tmp_path: Path) -> None:
    """Rank 1 raises; rank 0's next collective fails because rank 1 died, and raises too (later): the
    launcher names rank 1 and its exception, and no line carries the rank prefix twice."""
    proc = _commd(["launch", "--nproc-per-node", "2", "--grace", "3", "--job", "raising",
                   str(SCRIPTS / "cli_raise_worker.py")], timeout=120)
    assert proc.returncode == 1, proc.stderr
    verdict = [line for line in proc.stderr.splitlines() if line.startswith("commd launch: rank")]
    assert len(verdict) == 1, proc.stderr
    assert verdict[0].startswith("commd launch: rank 1 (pid ") and "failed first: exited with code 1" in verdict[0]
    assert "ValueError: boom on rank 1" in verdict[0], verdict
    assert "[rank1]:[rank1]:" not in proc.stderr and "[rank0]:[rank0]:" not in proc.stderr, proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc-per-node", "0", "{script}"], "at least 1"),
        (["--master-port", "70000", "{script}"], "[1, 65535]"),
        (["--job", "bad/name", "{script}"], "job name"),
        (["no_such_script.py"], "no such script"),
        (["--max-restarts", "-1", "{script}"], "--max-restarts must lie in [0, 1000]"),
    ],
)
def test_launch_rejects_bad_arguments(
    rt: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    script = str(SCRIPTS / "cli_allreduce_worker.py")
    code = commd_main(["launch", *[a.replace("{script}", script) for a in argv]])
    assert code == 2
    assert message in capsys.readouterr().err
    assert list(rt.iterdir()) == []  # nothing was started


# ---- status -------------------------------------------------------------------------
@pytest.fixture
def running_job(rt: Path) -> Iterator[tuple[JobPaths, Client]]:
    """A daemon with one connected client that has completed a few all-reduces."""
    paths = JobPaths.for_job("statusjob")
    daemon = start_daemon(paths, new_secret(), exit_when_idle=False, timeout=60)
    client = None
    try:
        client = Client(0, 1, job=paths.job, arena_bytes=1 << 20)
        client.register_group("world", [0])
        for _ in range(3):
            ops.all_reduce(client, torch.ones(1000), group="world").wait(30)
        yield paths, client
    finally:
        if client is not None:
            client.close()
        stop_daemon(daemon)


@pytest.mark.timeout(90)
def test_status_json_reports_documented_keys(
    running_job: tuple[JobPaths, Client], capsys: pytest.CaptureFixture[str]
) -> None:
    paths, _client = running_job
    # No --job: the only job with a live daemon is found.
    assert commd_main(["status", "--json"]) == 0
    out = capsys.readouterr().out
    status = json.loads(out)
    assert set(status) >= STATUS_KEYS
    assert out.index('"bytes_moved"') < out.index('"clients"') < out.index('"job"')  # sorted keys
    assert status["job"] == paths.job
    assert [(c["rank"], c["pid"]) for c in status["clients"]] == [(0, os.getpid())]
    assert status["clients"][0]["arena_bytes"] >= 1 << 20
    (group,) = status["groups"].values()
    assert set(group) >= GROUP_KEYS and group["done"] == 3
    assert set(status["latency_us"]["allreduce"]) >= {"count", "p50_us", "p90_us", "p99_us"}
    assert status["oldest_waiting"] is None

    assert commd_main(["status", "--job", paths.job]) == 0
    table = capsys.readouterr().out
    for word in ("uptime", "clients (1)", "allreduce", "p99", "KiB", "last errors", "garbage collector"):
        assert word in table, table


@pytest.mark.timeout(30)
def test_status_without_daemon_fails_clearly(rt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert commd_main(["status"]) == 1
    err = capsys.readouterr().err
    assert "no running commd daemon" in err and str(rt) in err
    assert commd_main(["status", "--job", "nosuchjob"]) == 1
    assert "nosuchjob" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_status_lists_jobs_when_several_run(rt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for job in ("jobA", "jobB"):
        paths = JobPaths.for_job(job).ensure()
        paths.pid_file.write_text(str(os.getpid()))  # a live pid stands in for a daemon
    assert commd_main(["status"]) == 1
    err = capsys.readouterr().err
    assert "several jobs" in err and "jobA" in err and "jobB" in err


@pytest.mark.timeout(30)
def test_status_times_out_on_a_silent_daemon(rt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A socket that never answers gives exit 1 within the timeout, not a hang."""
    paths = JobPaths.for_job("silent").ensure()
    paths.write_secret("x")
    paths.pid_file.write_text(str(os.getpid()))
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(paths.endpoint)
    paths.socket.chmod(0o600)  # as a daemon makes it: status talks only to a private socket of ours
    try:
        start = time.monotonic()
        assert commd_main(["status", "--timeout", "0.5"]) == 1
        assert time.monotonic() - start < 5
        assert "did not answer" in capsys.readouterr().err
    finally:
        sock.close()


def test_human_sizes() -> None:
    assert status_cli.human_bytes(512) == "512 B"
    assert status_cli.human_bytes(1536) == "1.5 KiB"
    assert status_cli.human_bytes(64 << 20) == "64.0 MiB"
    assert status_cli.human_seconds(75) == "1m15s"


# ---- demo ---------------------------------------------------------------------------
@pytest.mark.timeout(200)
def test_free_port_is_bindable_and_falls_back_for_a_foreign_address() -> None:
    """``runtime.free_port`` (the launcher's and the demo's master port) gives a port a server can bind;
    an address this host does not have still yields a port (any address) instead of an error."""
    for addr in ("127.0.0.1", "192.0.2.1"):  # 192.0.2.0/24 is TEST-NET-1: never a local address
        port = free_port(addr)
        assert 1024 <= port <= 65535, (addr, port)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("127.0.0.1", port))  # raises if the port were taken


@pytest.mark.extended
def test_demo_tiny_runs_both_backends(rt: Path) -> None:
    proc = _commd(["demo", "--nproc", "2", "--steps", "3", "--size", "64", "--layers", "1",
                   "--bench-iters", "1", "--timeout", "80"], timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "commd loss" in out and "gloo loss" in out
    assert "losses match" in out
    assert "busbw" in out and "speedup" in out
    assert "clients (2)" in out  # the daemon's status, taken while the workers were connected
    assert _no_live_daemon(rt)
