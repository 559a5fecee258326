"""Fixtures giving each test its own runtime dir, job, daemon and workers, always cleaned up."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster import Cluster, free_port
from helpers import DaemonProcess, Workers, kill_pid, new_job
from simhosts import sim_hosts  # noqa: F401 - fixture for tests with simulated hosts


@pytest.fixture(autouse=True, scope="session")
def _private_tuning_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Daemons started by tests never load a table `commd tune` left in this machine's default location."""
    saved = {k: os.environ.get(k) for k in ("COMMD_TUNING_DIR", "COMMD_TUNING")}
    os.environ["COMMD_TUNING_DIR"] = str(tmp_path_factory.mktemp("tuning"))
    os.environ.pop("COMMD_TUNING", None)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def runtime_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private COMMD_RUNTIME_DIR (short, so the sockets stay in the job directory as they usually do)."""
    path = tmp_path_factory.mktemp("rt")
    monkeypatch.setenv("COMMD_RUNTIME_DIR", str(path))
    monkeypatch.delenv("COMMD_JOB", raising=False)
    monkeypatch.delenv("COMMD_SECRET", raising=False)
    return path


@pytest.fixture
def backend_env(runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """torch ranks started by the test: MASTER_ADDR/PORT for env://, no launcher job, no inherited
    rank or timeout settings; kills any daemon the ranks started."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "COMMD_JOB", "COMMD_OP_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    yield runtime_dir
    for pid_file in runtime_dir.glob("*/daemon.pid"):
        try:
            kill_pid(int(pid_file.read_text()))
        except (OSError, ValueError):
            pass


@pytest.fixture
def job() -> str:
    return new_job()


@pytest.fixture
def start_daemon(runtime_dir: Path, job: str) -> Iterator[Callable[..., DaemonProcess]]:
    """Factory: start this test's daemon (not yet waited for); killed at teardown."""
    started: list[DaemonProcess] = []

    def start(op_timeout: float = 20.0, extra: list[str] | None = None) -> DaemonProcess:
        daemon = DaemonProcess.start(runtime_dir, job, op_timeout, extra)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()
        print(f"--- daemon {daemon.job} log tail ---\n{daemon.log_tail()}")


@pytest.fixture
def daemon(start_daemon: Callable[..., DaemonProcess]) -> DaemonProcess:
    """A ready daemon with the default op timeout."""
    return start_daemon().wait_ready()


@pytest.fixture
def start_workers(runtime_dir: Path, job: str) -> Iterator[Callable[..., Workers]]:
    """Factory: start worker processes for this test's job; killed at teardown."""
    started: list[Workers] = []

    def start(target: Callable[..., Any], world_size: int, *args: Any, ranks: list[int] | None = None) -> Workers:
        workers = Workers(target, world_size, job, runtime_dir, args, ranks)
        started.append(workers)
        return workers.start()

    yield start
    for workers in started:
        workers.close()


@pytest.fixture
def connect(job: str) -> Iterator[Callable[..., Any]]:
    """Factory: an in-process Client of this test's job with 'world' registered; closed at teardown."""
    from commd.client import Client

    clients: list[Any] = []

    def make(rank: int, world_size: int, **kwargs: Any) -> Any:
        client = Client(rank, world_size, job=job, connect_timeout=20.0, **kwargs)
        clients.append(client)
        client.register_group("world", list(range(world_size)))
        return client

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """A multi-node job on loopback (tests/cluster.py): ``cluster(nnodes, nproc, **kwargs)``, stopped afterwards."""
    made: list[Cluster] = []

    def make(nnodes: int = 2, nproc: int = 2, **kwargs) -> Cluster:
        monkeypatch.delenv("COMMD_SECRET", raising=False)
        c = Cluster(tmp_path_factory.mktemp("fab"), nnodes, nproc, **kwargs)
        made.append(c)
        return c.start()

    yield make
    for c in made:
        c.stop()
        print(c.logs())
