"""MpiLane: the primitives under a real ``mpiexec -n 3``, and the MPI-free parts in process.

The pytest process never initialises MPI: the worker script does the
collective checks in its own ranks, and the in-process tests use a stand-in
communicator to show that ``can_run``, the argument checks and
``mpi_world_size_from_env`` never import ``mpi4py.MPI``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from commd.lanes.base import PRIMITIVES, LaneError
from commd.lanes.mpi import WORLD_SIZE_ENV, MpiLane, mpi_can_run, mpi_world_size_from_env

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "scripts" / "mpi_lane_worker.py"
WORKER_TIMEOUT_S = 120


def _mpiexec() -> str | None:
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


class FakeComm:
    """Just enough of a communicator for MpiLane's constructor (rank 1 of 3)."""

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's spelling
        return 1

    def Get_size(self) -> int:  # noqa: N802
        return 3


def test_worker_under_mpiexec() -> None:
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec next to the interpreter or on PATH (pip install mpich)")
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed")
    env = {k: v for k, v in os.environ.items() if k not in WORLD_SIZE_ENV and not k.startswith("PMI_")}
    try:
        proc = subprocess.run(
            [mpiexec, "-n", "3", sys.executable, str(WORKER)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"mpiexec did not finish in {WORKER_TIMEOUT_S}s\nstdout:\n{exc.stdout}\nstderr:\n{exc.stderr}")
    output = f"rc {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0, output
    assert proc.stdout.count("checks passed") == 3, output


def test_world_size_from_env() -> None:
    assert mpi_world_size_from_env({}) is None
    assert mpi_world_size_from_env({"PMI_SIZE": "4"}) == 4
    assert mpi_world_size_from_env({"OMPI_COMM_WORLD_SIZE": "8"}) == 8
    assert mpi_world_size_from_env({"MV2_COMM_WORLD_SIZE": "2"}) == 2
    assert mpi_world_size_from_env({"PMI_SIZE": "3", "OMPI_COMM_WORLD_SIZE": "9"}) == 3  # first in order wins
    assert mpi_world_size_from_env({"PMI_SIZE": "", "OMPI_COMM_WORLD_SIZE": "5"}) == 5
    assert mpi_world_size_from_env({"PMI_SIZE": "zero"}) is None
    assert mpi_world_size_from_env({"PMI_SIZE": "0"}) is None
    assert mpi_world_size_from_env({"MPI_LOCALNRANKS": "1"}) is None  # ranks on this host, not the world


def test_world_size_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in WORLD_SIZE_ENV:
        monkeypatch.delenv(name, raising=False)
    assert mpi_world_size_from_env() is None
    monkeypatch.setenv("PMI_SIZE", "6")
    assert mpi_world_size_from_env() == 6


def test_can_run_answers() -> None:
    lane = MpiLane(FakeComm())
    nodes = (0, 1, 2)
    for dtype in ("float16", "bfloat16"):
        reason = lane.can_run("allreduce", dtype, "sum", nodes)
        assert reason is not None and dtype in reason and "MPI" in reason
    assert "SUM and PROD only" in (lane.can_run("allreduce", "complex64", "max", nodes) or "")
    assert "integer or bool" in (lane.can_run("allreduce", "float32", "bor", nodes) or "")
    assert "avg" in (lane.can_run("allreduce", "float32", "avg", nodes) or "")
    assert "outside" in (lane.can_run("barrier", "uint8", None, (0, 3)) or "")
    assert "no primitive" in (lane.can_run("scatter", "uint8", None, nodes) or "")
    for dtype, op in [("bool", "sum"), ("bool", "bxor"), ("bool", "min"), ("int16", "band"), ("uint8", "bxor"),
                      ("complex128", "product"), ("float64", "max"), ("int64", "product")]:
        assert lane.can_run("allreduce", dtype, op, nodes) is None, (dtype, op)
    for primitive in PRIMITIVES:  # moved as MPI_BYTE: every dtype
        if primitive != "allreduce":
            assert lane.can_run(primitive, "bfloat16", None, nodes) is None, primitive
    assert mpi_can_run("allreduce", "int8", "sum", nodes, 3) is None


def test_argument_checks_and_close_need_no_mpi() -> None:
    lane = MpiLane(FakeComm())
    u8 = torch.zeros(4, dtype=torch.uint8)
    for call in (
        lambda: lane.barrier((0, 2), 1.0),  # without this node
        lambda: lane.barrier((2, 1), 1.0),  # unsorted
        lambda: lane.broadcast((0, 1), u8, 2, 1.0),  # root not a member
        lambda: lane.send(1, u8, 1.0),  # to itself
        lambda: lane.allreduce((0, 1), torch.zeros(2, dtype=torch.float16), "sum", 1.0),
        lambda: lane.allgatherv((0, 1), u8, u8, [4, 4], 1.0),
        lambda: lane.broadcast((0, 1), torch.zeros(8)[::2], 0, 1.0),  # not contiguous
    ):
        with pytest.raises(LaneError) as info:
            call()
        assert info.value.code == "internal"
    lane.barrier((1,), 1.0)  # a lone member needs nobody
    lane.close()
    with pytest.raises(LaneError, match="closed"):
        lane.barrier((1,), 1.0)


def test_importing_and_asking_never_initialise_mpi() -> None:
    code = (
        "import sys\n"
        "import commd.lanes.mpi as m\n"
        "class C:\n"
        "    def Get_rank(self): return 0\n"
        "    def Get_size(self): return 2\n"
        "lane = m.MpiLane(C())\n"
        "assert lane.can_run('allreduce', 'float32', 'sum', (0, 1)) is None\n"
        "m.mpi_world_size_from_env()\n"
        "assert 'mpi4py.MPI' not in sys.modules, 'mpi4py.MPI was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
