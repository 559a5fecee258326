"""benchmarks/device_check.py: the JSON of figures, the GPU parts' skip reason, budgets and timeouts, the
cuda-ipc part's program (on host tensors here).

The parts themselves are the GPU machine's; here the script runs with the GPU
parts (skipped without a CUDA device, in seconds) and with stand-in parts
whose outcome is known (ok, failed, timed out, over the budget).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "device_check.py"
GPU_PARTS = ["gpu-tests", "cuda-ipc", "gpu-codecs", "gpu-allreduce"]
LOAD_KEYS = {"1m", "5m", "15m"}


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _check_document(data: dict[str, Any], names: list[str]) -> None:
    """The schema docs/device-check.md describes."""
    assert data["format"] == "commd-device-check" and data["version"] == 1
    assert time.strptime(data["date"], "%Y-%m-%dT%H:%M:%S%z")
    assert set(data["machine"]) >= {"gpu", "gpu_count", "driver", "cuda", "torch", "cores", "python", "commd"}
    assert data["machine"]["cores"] == os.cpu_count() and data["machine"]["torch"] == torch.__version__
    for when in ("start", "end"):
        assert set(data["load"][when]) == LOAD_KEYS
    assert [p["name"] for p in data["parts"]] == names
    for part in data["parts"]:
        assert part["status"] in ("ok", "failed", "skipped")
        assert isinstance(part["duration_s"], float) and isinstance(part["figures"], dict)
        assert (part["reason"] is None) == (part["status"] == "ok")


def test_gpu_parts_skip_with_the_reason_without_a_gpu(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: `make device-check` runs the GPU parts here")
    out = tmp_path / "check.json"
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(SCRIPT), "--parts", ",".join(GPU_PARTS), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert time.monotonic() - started < 60
    data = json.loads(out.read_text())
    _check_document(data, GPU_PARTS)
    assert data["machine"]["gpu"] is None and data["quick"] is True
    for part in data["parts"]:
        assert part["status"] == "skipped" and part["duration_s"] == 0.0
        assert part["reason"] == "no CUDA device: torch.cuda.is_available() is False"
    for name in GPU_PARTS:  # the summary table
        assert f"{name}" in done.stdout and "skipped" in done.stdout
    assert f"wrote {out}" in done.stdout


def test_bad_parts_are_refused(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--parts", "gpu-tests,frobnicate", "--out",
                           str(tmp_path / "x.json")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--parts: unknown frobnicate" in done.stderr
    assert not (tmp_path / "x.json").exists()


def test_parts_ok_failed_timed_out_and_over_the_budget(tmp_path: Path) -> None:
    """Stand-in parts through the real runner: figures read from the part's output, a failure's exit code and
    last line, a timeout that stops the part's whole session, a part the budget left no room for."""
    dc = _module()
    marker = tmp_path / "grandchild-survived"
    py = sys.executable
    parts = [
        dc.Part("fine", False, 1, 30, lambda ctx, out: [py, "-c", f"open({str(out)!r}, 'w').write('{{\"x\": 1}}')"],
                figures=lambda ctx, out, log: json.loads(out.read_text()), headline=lambda f: f"x={f['x']}"),
        dc.Part("broken", False, 1, 30, lambda ctx, out: [py, "-c", "import sys; print('it broke'); sys.exit(3)"]),
        dc.Part("slow", False, 1, 2, lambda ctx, out: ["bash", "-c", f"(sleep 4; touch {marker}) & sleep 60"]),
        dc.Part("huge", False, 10_000, 30, lambda ctx, out: [py, "-c", "pass"]),
        dc.Part("gpu-only", True, 1, 30, lambda ctx, out: [py, "-c", "pass"], needs=lambda ctx: dc.NO_CUDA),
    ]
    ctx = dc.Context(quick=True, work=tmp_path, cuda={"available": False}, mpiexec=None)
    started = time.monotonic()
    entries = {e["name"]: e for e in dc.run_parts(parts, ctx, budget_s=300)}
    assert time.monotonic() - started < 30
    assert entries["fine"]["status"] == "ok" and entries["fine"]["figures"] == {"x": 1}
    assert entries["fine"]["headline"] == "x=1" and entries["fine"]["reason"] is None
    assert entries["broken"]["status"] == "failed" and entries["broken"]["reason"] == "exit code 3: it broke"
    assert entries["slow"]["status"] == "failed" and entries["slow"]["reason"] == "timed out after 2 s (stopped)"
    assert 2 <= entries["slow"]["duration_s"] < 20
    assert entries["huge"]["status"] == "skipped" and entries["huge"]["reason"].startswith("over the budget: ")
    assert "takes about 10000 s" in entries["huge"]["reason"]
    assert entries["gpu-only"]["status"] == "skipped" and entries["gpu-only"]["reason"] == dc.NO_CUDA
    # The stopped part's background subshell was in its session: it goes too (its command line names marker),
    # once the kernel has delivered the signal and its parent reaped it.
    wait_until(lambda: not any(str(marker) in line for line in _cmdlines()), 10, "the stopped part's subshell to go")
    table = dc.summary(list(entries.values())).splitlines()
    assert table[0].split() == ["part", "status", "seconds", "figures", "or", "reason"]
    assert table[1].split()[:2] == ["fine", "ok"] and table[1].endswith("x=1")


def _cmdlines() -> list[str]:
    """Every process's command line (those that end while we look are left out)."""
    lines = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            lines.append(path.read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return lines


def test_trim_summarizes_raw_times_only() -> None:
    dc = _module()
    times = [float(i) for i in range(101)]
    assert dc.trim({"times": times, "sizes": [1, 2, 3], 1024: {"median_us": 5.0}}) == {
        "times": {"n": 101, "median": 50.0, "min": 0.0, "max": 100.0}, "sizes": [1, 2, 3], "1024": {"median_us": 5.0}}


@pytest.mark.extended
def test_cuda_ipc_program_on_host_tensors(tmp_path: Path) -> None:
    """The cuda-ipc part's program end to end on host tensors (daemon, 2 ranks, checked results, the
    daemon's bytes by path): what runs on the GPU machine with CUDA tensors."""
    out = tmp_path / "probe.json"
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if k not in ("COMMD_JOB", "COMMD_SECRET")}
    env.update(COMMD_RUNTIME_DIR=str(runtime), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(SCRIPT), "--probe", "cuda-ipc", "--probe-device", "cpu", "--quick",
                           "--probe-out", str(out)], env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and "error" not in data
    sizes = [str(s) for s in data["sizes"]]
    for mode in ("ipc", "staged"):
        assert list(data["modes"][mode]["median_us"]) == sizes
        assert all(v > 0 for v in data["modes"][mode]["median_us"].values())
        moved = data["modes"][mode]["bytes_by_path"]
        assert "cuda" not in moved and sum(moved.values()) > 0  # host tensors: never the CUDA path
