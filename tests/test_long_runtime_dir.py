"""A runtime directory deeper than a Unix socket address allows still runs a job.

A socket path may hold at most 107 bytes on Linux; a job directory under a deep
``COMMD_RUNTIME_DIR`` (a home on a parallel file system, a CI workspace) passes that.
The job's sockets then live in a short private directory that the daemon and its
clients derive alike from the job directory's path; everything else stays in the
job directory.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import wait_until
from test_torch_backend import spawn

from commd.runtime import MAX_SOCKET_PATH, SOCKET_NAME, JobPaths

pytestmark = pytest.mark.timeout(240)

WORLD = 2
STEPS = 3


def _deep(base: Path, length: int) -> Path:
    """A directory under ``base`` whose path is ``length`` characters long (components of at most 40)."""
    path = base
    while len(str(path)) < length:
        path = path / ("d" * min(40, length - len(str(path)) - 1))
    assert len(str(path)) == length, path
    return path


def test_a_short_job_directory_keeps_its_sockets(tmp_path: Path) -> None:
    paths = JobPaths("job", tmp_path / "job")
    assert paths.socket_dir == paths.directory
    assert paths.socket == tmp_path / "job" / SOCKET_NAME


def test_a_long_job_directory_gets_a_short_private_socket_directory(tmp_path: Path) -> None:
    deep = _deep(tmp_path, 150)
    paths = JobPaths("job", deep / "job")
    assert len(str(paths.directory / SOCKET_NAME)) > MAX_SOCKET_PATH
    assert paths.socket_dir != paths.directory
    assert len(os.fsencode(paths.socket)) <= MAX_SOCKET_PATH and len(os.fsencode(paths.ops_socket)) <= MAX_SOCKET_PATH
    assert JobPaths("job", deep / "job").socket == paths.socket  # every process derives the same place
    assert JobPaths("other", deep / "other").socket_dir != paths.socket_dir
    paths.ensure()
    try:
        st = os.lstat(paths.socket_dir)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
        paths.verify()
    finally:
        paths.socket_dir.rmdir()


def _train_rank(rank: int, runtime_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), COMMD_RUNTIME_DIR=runtime_dir)
    import commd  # noqa: F401 - registers the backend

    dist.init_process_group("commd")
    assert dist.get_backend() == "commd"
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    reference = torch.nn.Linear(8, 4)
    reference.load_state_dict(model.module.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(STEPS):
        inputs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(step * WORLD + r)) for r in range(WORLD)]
        optimizer.zero_grad()
        model(inputs[rank]).pow(2).mean().backward()
        optimizer.step()
        # one process on the whole batch: DDP averages the ranks' gradients of equal-sized shards
        ref_optimizer.zero_grad()
        reference(torch.cat(inputs)).pow(2).mean().backward()
        ref_optimizer.step()
    for got, want in zip(model.module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want)
    dist.destroy_process_group()


@pytest.mark.extended
def test_a_job_under_a_150_character_runtime_directory_trains(backend_env: Path, tmp_path: Path) -> None:
    runtime = _deep(tmp_path, 150)
    spawn(_train_rank, (str(runtime),))
    logs = sorted(runtime.glob("*/daemon.log"))
    assert len(logs) == 1, f"expected one auto-started daemon's log under {runtime}, found {logs}"
    text = logs[0].read_text()
    assert "sockets in /tmp/" in text, text[-2000:]
    paths = JobPaths(logs[0].parent.name, logs[0].parent)
    wait_until(lambda: "daemon stopped" in logs[0].read_text(), 30, "the idle daemon to exit")
    assert not paths.socket_dir.exists(), "the daemon left its socket directory behind"
