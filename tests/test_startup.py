"""Start-up cost and the launcher's and bench's paper cuts.

* The ``commd`` command and a single-node daemon do not import torch (it costs
  seconds): checked in fresh subprocesses through ``sys.modules`` and, for a
  running daemon, through the libraries mapped into it (/proc/PID/maps).
* ``import commd`` still registers the "commd" backend, for every import
  order and with torch's backend autoloading on or off; one order is proven by
  a real ``init_process_group("commd")`` and all-reduce.
* ``commd launch``: rank-prefixed output, a missing script or module, unknown flags.
* ``commd bench`` JSON: spec, arguments, versions and host; the plot's log scales.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import new_job, wait_until

from commd.client.spawn import start_daemon
from commd.runtime import JobPaths, new_secret

ROOT = Path(__file__).resolve().parent.parent
#: Generous bound for one subprocess on a loaded machine (torch's import alone can take 10 s there).
SUBPROCESS_S = 90


@pytest.fixture
def rt(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private runtime root (short: ipc socket paths are limited to ~107 bytes)."""
    path = tmp_path_factory.mktemp("su")
    monkeypatch.setenv("COMMD_RUNTIME_DIR", str(path))
    for key in ("COMMD_JOB", "COMMD_SECRET"):
        monkeypatch.delenv(key, raising=False)
    return path


def _python(code: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True,
                          timeout=SUBPROCESS_S, env=dict(os.environ, **(env or {})), check=False)


def _commd(args: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "commd", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=SUBPROCESS_S, env=dict(os.environ), check=False)


#: Runs `commd ARGV` in process, then says whether torch got imported (last line of stdout).
_CLI_PROBE = """
    import sys
    from commd.cli.main import main
    try:
        code = main({argv!r})
    except SystemExit as exc:
        code = exc.code
    print()
    print("exit", code, "torch-imported" if "torch" in sys.modules else "torch-absent")
"""


def _cli_imports_torch(argv: list[str]) -> tuple[bool, str]:
    proc = _python(_CLI_PROBE.format(argv=argv))
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    return last.endswith("torch-imported"), proc.stdout + proc.stderr


@pytest.fixture
def daemon(rt: Path) -> Iterator[subprocess.Popen]:
    """A job daemon started the way the torch backend starts one (answering when this returns)."""
    yield from _daemon()


@pytest.fixture
def lazy_daemon(rt: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[subprocess.Popen]:
    """A daemon that loads torch only when an op needs it (no warm-up)."""
    monkeypatch.setenv("COMMD_TORCH_WARMUP", "0")
    yield from _daemon()


def _daemon() -> Iterator[subprocess.Popen]:
    paths = JobPaths.for_job(new_job())
    proc = start_daemon(paths, new_secret(), exit_when_idle=False, timeout=SUBPROCESS_S)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _job_of(proc: subprocess.Popen) -> str:
    return proc.args[proc.args.index("--job") + 1]


def _maps_torch(pid: int) -> bool:
    """Whether torch's native library is mapped into process ``pid`` (it is once torch is imported)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


# ---- no torch on the command line and in a daemon that does not need it ---------------
@pytest.mark.parametrize("argv", [["--help"], ["status", "--help"], ["launch", "--help"], ["daemon", "--help"],
                                  ["bench", "--help"]])
def test_cli_help_does_not_import_torch(argv: list[str]) -> None:
    imported, output = _cli_imports_torch(argv)
    assert "usage: commd" in output
    if argv[0] == "bench":
        return  # bench and tune may import what they measure; only their own usage is checked here
    assert not imported, f"`commd {' '.join(argv)}` imported torch"


def test_status_against_a_running_daemon_imports_torch_nowhere(lazy_daemon: subprocess.Popen) -> None:
    daemon = lazy_daemon
    job = _job_of(daemon)
    imported, output = _cli_imports_torch(["status", "--job", job, "--json"])
    assert "exit 0" in output, output
    status = json.loads(output[output.index("{"): output.rindex("}") + 1])
    assert status["pid"] == daemon.pid and status["clients"] == []
    assert not imported, "`commd status` imported torch"
    assert not _maps_torch(daemon.pid), "a daemon that has run nothing loaded torch"


def test_a_daemon_warms_torch_up_in_the_background_and_runs_torch_kernels(daemon: subprocess.Popen) -> None:
    """By default torch loads in the background; a bfloat16 all-reduce (no NumPy kernel) gives the right sums."""
    import torch

    from commd.client import ops
    from commd.client.connection import Client

    job = _job_of(daemon)
    clients = [Client(rank, 2, local_rank=rank, job=job) for rank in (0, 1)]
    try:
        wait_until(lambda: _maps_torch(daemon.pid), SUBPROCESS_S, "the daemon to warm torch up")
        for c in clients:
            c.register_group("world", [0, 1])
        tensors = [torch.arange(100_000, dtype=torch.float32).to(torch.bfloat16) * (rank + 1) for rank in (0, 1)]
        expected = tensors[0] * 3  # exact in bfloat16: x + 2x
        handles = [ops.all_reduce(c, t) for c, t in zip(clients, tensors, strict=True)]
        for handle in handles:
            handle.wait(SUBPROCESS_S)
        for t in tensors:
            assert torch.equal(t, expected)
    finally:
        for c in clients:
            c.close()


def test_small_ops_run_without_torch_and_a_bfloat16_op_loads_it(lazy_daemon: subprocess.Popen) -> None:
    import torch

    from commd.client import ops
    from commd.client.connection import Client

    clients = [Client(rank, 2, local_rank=rank, job=_job_of(lazy_daemon)) for rank in (0, 1)]
    try:
        for c in clients:
            c.register_group("world", [0, 1])

        def all_reduce(dtype: torch.dtype, n: int) -> None:
            tensors = [torch.arange(n, dtype=torch.float32).to(dtype) * (rank + 1) for rank in (0, 1)]
            expected = tensors[0] * 3
            for handle in [ops.all_reduce(c, t) for c, t in zip(clients, tensors, strict=True)]:
                handle.wait(SUBPROCESS_S)
            for t in tensors:
                assert torch.equal(t, expected)

        for dtype in (torch.float32, torch.int64, torch.float16):
            all_reduce(dtype, 1000)
        assert not _maps_torch(lazy_daemon.pid), "small NumPy-kernel all-reduces loaded torch in the daemon"
        all_reduce(torch.bfloat16, 1000)  # NumPy has no bfloat16: torch's kernels
        assert _maps_torch(lazy_daemon.pid)
    finally:
        for c in clients:
            c.close()


# ---- registration of the backend ----------------------------------------------------
_ORDERS = {
    "commd, then torch.distributed": "import commd\nimport torch.distributed as dist",
    "commd, then torch": "import commd\nimport torch\nimport torch.distributed as dist",
    "torch, then commd": "import torch\nimport commd\nimport torch.distributed as dist",
    "torch.distributed, then commd": "import torch.distributed as dist\nimport commd",
}


@pytest.mark.parametrize("autoload", ["0", "1"])
@pytest.mark.parametrize("order", sorted(_ORDERS))
def test_import_commd_registers_the_backend_in_any_order(order: str, autoload: str) -> None:
    code = "import importlib.machinery, sys\nbefore = len(sys.meta_path)\n" + _ORDERS[order] + textwrap.dedent("""
        import torch
        assert "commd" in dist.Backend.backend_list, dist.Backend.backend_list
        assert dist.Backend("commd") == "commd"
        # the hook is gone and torch kept its own loader
        assert len(sys.meta_path) == before, sys.meta_path
        assert isinstance(torch.__spec__.loader, importlib.machinery.SourceFileLoader), torch.__spec__.loader
        assert isinstance(dist.__spec__.loader, importlib.machinery.SourceFileLoader), dist.__spec__.loader
        print("registered")
    """)
    proc = _python(code, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": autoload})
    assert proc.returncode == 0 and "registered" in proc.stdout, proc.stderr


def test_autoloading_registers_without_import_commd() -> None:
    if not any(e.value.startswith("commd.") for e in importlib.metadata.entry_points(group="torch.backends")):
        pytest.skip("commd is not installed (no torch.backends entry point)")
    proc = _python("import torch.distributed as dist\nassert 'commd' in dist.Backend.backend_list\nprint('ok')",
                   env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "1"})
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_init_process_group_after_import_commd_before_torch_without_autoload(rt: Path, tmp_path: Path) -> None:
    code = f"""
        import commd  # before torch, and torch's autoloading is off: only commd's hook can register
        import sys
        assert "torch" not in sys.modules
        import torch
        import torch.distributed as dist
        dist.init_process_group("commd", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        t = torch.arange(8, dtype=torch.float64)
        dist.all_reduce(t)
        assert t.tolist() == list(range(8)), t
        dist.destroy_process_group()
        print("all-reduced")
    """
    proc = _python(code, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert proc.returncode == 0 and "all-reduced" in proc.stdout, proc.stderr


# ---- commd launch ---------------------------------------------------------------------
def test_launch_prefixes_every_worker_line_with_its_rank(rt: Path, tmp_path: Path) -> None:
    script = tmp_path / "talk.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        rank = os.environ["RANK"]
        for i in range(3):
            print(f"out {rank} {i}")
        print(f"err {rank}", file=sys.stderr)
        sys.stdout.write(f"tail {rank}")  # no newline at the end
    """))
    proc = _commd(["launch", "--nproc-per-node", "2", str(script)])
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    for rank in (0, 1):
        assert [line for line in out if line.startswith(f"[rank{rank}]:")] == [
            f"[rank{rank}]:out {rank} 0", f"[rank{rank}]:out {rank} 1", f"[rank{rank}]:out {rank} 2",
            f"[rank{rank}]:tail {rank}"]
        assert f"[rank{rank}]:err {rank}" in proc.stderr.splitlines()
    assert all(line.startswith(("[rank0]:", "[rank1]:")) for line in out), out

    filtered = _commd(["launch", "--nproc-per-node", "2", "--local-ranks-filter", "1", str(script)])
    assert filtered.returncode == 0, filtered.stderr
    assert not any(line.startswith("[rank0]:") for line in filtered.stdout.splitlines())
    assert "[rank1]:out 1 0" in filtered.stdout.splitlines()
    assert "[rank0]:err 0" in filtered.stderr.splitlines()  # errors are never filtered away


def test_launch_reports_a_missing_script_or_module(rt: Path, tmp_path: Path) -> None:
    proc = _commd(["launch", "--nproc-per-node", "2", str(tmp_path / "absent.py")], cwd=tmp_path)
    assert proc.returncode != 0
    assert f"no such script: '{tmp_path / 'absent.py'}'" in proc.stderr, proc.stderr
    proc = _commd(["launch", "-m", "no_such_package_here.train"], cwd=tmp_path)
    assert proc.returncode != 0
    assert "no such module: 'no_such_package_here.train'" in proc.stderr, proc.stderr
    assert list(rt.iterdir()) == []  # no daemon was started


def test_launch_unknown_flag_prints_launch_usage(rt: Path, tmp_path: Path) -> None:
    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    proc = _commd(["launch", "--bogus-flag", "2", str(script)])
    assert proc.returncode == 2
    assert "usage: commd launch" in proc.stderr, proc.stderr
    assert "unrecognized arguments: --bogus-flag" in proc.stderr
    assert list(rt.iterdir()) == []


# ---- commd bench report ---------------------------------------------------------------
def _rows() -> list[dict]:
    rows = []
    for op in ("allreduce", "barrier"):
        for size in ((0,) if op == "barrier" else (1024, 65536, 16 << 20)):
            for path, us in (("commd/local", 10.0), ("gloo", 30.0)):
                t = us * (1 + size / 1e6)
                rows.append({"op": op, "bytes": size, "path": path, "via": path.split("/")[0], "iters": 3,
                             "median_us": t, "p95_us": t * 1.2, "algbw_gbs": size / t / 1e3,
                             "busbw_gbs": size / t / 1e3, "factor": 1.0, "check": "ok", "world": 2})
    return rows


def test_bench_json_records_spec_arguments_versions_and_host(tmp_path: Path) -> None:
    import mpi4py
    import numpy
    import torch

    import commd
    from commd.bench import report

    spec = {"ops": ["allreduce"], "sizes": [1024], "dtype": "float32"}
    meta = {"world": 2, "nnodes": 1, "node_names": ["n0"], "ranks_per_node": [2], "spec": spec}
    args = argparse.Namespace(ops="allreduce", nproc=2, json=str(tmp_path / "b.json"), plot=None, run=print)
    report.write_json(str(tmp_path / "b.json"), meta, _rows(), {"arguments": report.arguments_json(args)})
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["spec"] == spec
    assert data["arguments"] == {"json": str(tmp_path / "b.json"), "nproc": 2, "ops": "allreduce", "plot": None}
    versions = data["versions"]
    assert versions["commd"] == commd.__version__
    assert versions["torch"] == torch.__version__
    assert versions["numpy"] == numpy.__version__
    assert versions["mpi4py"] == mpi4py.__version__
    assert versions["python"] == ".".join(map(str, sys.version_info[:3]))
    assert data["host"]["hostname"] == os.uname().nodename
    assert data["host"]["cpus"] == os.cpu_count()


def test_bench_plot_has_log_scales_and_latency_panels() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from commd.bench import report

    fig = report.figure({"world": 2, "node_names": ["n0"]}, _rows())
    try:
        shown = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
        assert set(shown) == {"allreduce: bandwidth", "allreduce: latency"}  # barrier has no size axis
        for ax in shown.values():
            assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
        latency = shown["allreduce: latency"]
        smallest = min(min(line.get_xdata()) for line in latency.lines)
        assert smallest == 1024  # sizes below 64 KiB are on the plot, on their own decade
    finally:
        plt.close(fig)


def test_a_busy_daemon_is_waited_for_not_doubled(rt: Path) -> None:
    """A live daemon that answers late (a GPU node's first client makes it load torch for seconds) is the
    job's daemon: ensure_daemon waits for it instead of starting a second one, which would only fail
    with "already has a daemon" and fail the rank that tried."""
    from commd.client.spawn import ensure_daemon

    paths = JobPaths.for_job(new_job())
    proc = start_daemon(paths, new_secret(), exit_when_idle=False)
    try:
        os.kill(proc.pid, signal.SIGSTOP)  # alive, silent: longer than one ping's patience
        timer = __import__("threading").Timer(3.0, os.kill, (proc.pid, signal.SIGCONT))
        timer.start()
        try:
            assert ensure_daemon(paths, timeout=60) == proc.pid
        finally:
            timer.cancel()
            os.kill(proc.pid, signal.SIGCONT)
        assert proc.poll() is None and paths.daemon_pid() == proc.pid
        assert "already has a daemon" not in paths.log_file.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
