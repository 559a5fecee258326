"""The device check: what needs the GPU machine, and the multi-host benchmarks on its cores, in one bounded run.

`make device-check` (or `python benchmarks/device_check.py`) runs these parts in turn, each a
subprocess with its own timeout, all within --budget seconds (540 by default, so one call of 10
minutes holds it); a part that would not fit in what is left is skipped with the reason:

  gpu-tests      every test marked gpu (`pytest -m gpu`: tests/test_gpu.py's CUDA IPC path, the
                 sparse CUDA all-reduce), outcome per test
  cuda-ipc       CUDA tensors through the daemon: 2 ranks on GPU 0 all-reduce per size, once by CUDA
                 IPC handle and once staged through host memory (COMMD_CUDA_IPC=0); every result
                 checked, the daemon's bytes by path say which path ran
  gpu-codecs     benchmarks/gpu_codecs.py: bf16 rounding on the GPU against the CPU, compressed
                 broadcasts of CUDA tensors
  gpu-allreduce  benchmarks/gpu_allreduce.py: the commd backend against NCCL and Gloo directly on
                 CUDA tensors (NCCL refuses two ranks on one GPU: its refusal is the figure then)
  multinode      benchmarks/multinode.py --quick: commd's lanes against Gloo and MPI across 2
                 simulated hosts (root, network namespaces)
  algorithms     benchmarks/algorithms.py --quick: the library's programs against the tcp lane's
                 native algorithms and MPI on 4 simulated hosts (root, network namespaces)

Without a CUDA device the GPU parts are skipped with the reason and the others run.  It writes
one JSON of figures (--out, default out/device-check.json; its fields: docs/device-check.md)
and prints a summary table.  --parts picks parts, --quick shrinks every part to a smoke test.

    python benchmarks/device_check.py
    python benchmarks/device_check.py --parts gpu-tests,cuda-ipc --quick --out /tmp/check.json

Exit status: 0 when no part failed (skipped parts do not count), 1 otherwise, 2 for bad options.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PY = sys.executable
DEFAULT_BUDGET_S = 540.0
DEFAULT_OUT = ROOT / "out" / "device-check.json"
NO_CUDA = "no CUDA device: torch.cuda.is_available() is False"
#: Seconds a part gets between SIGTERM (the benchmarks remove their simulated hosts then) and SIGKILL.
STOP_GRACE_S = 20.0
#: Lists of more numbers than this (raw per-iteration times) are summarized in the JSON.
MAX_LIST = 64


@dataclass
class Context:
    """What every part's command and figures may use."""

    quick: bool
    work: Path
    cuda: dict[str, Any]
    mpiexec: str | None


@dataclass
class Part:
    """One part: its command, how long it may take, what it needs, how its figures are read."""

    name: str
    gpu: bool
    estimate_s: float  # what it takes on the GPU machine (16 cores): below this much budget left, skipped
    timeout_s: float  # its own bound (the budget left may cut it shorter)
    command: Callable[[Context, Path], list[str]]  # (context, its JSON output path) -> argv
    figures: Callable[[Context, Path, str], dict[str, Any]] = field(default=lambda ctx, out, log: {})
    needs: Callable[[Context], str | None] = field(default=lambda ctx: None)  # why it cannot run here
    headline: Callable[[dict[str, Any]], str] = field(default=lambda figures: "")


# ---- the machine -------------------------------------------------------------------------------------------
CUDA_PROBE = """
import json, torch
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available()}
if info["available"]:
    info["count"] = torch.cuda.device_count()
    info["name"] = torch.cuda.get_device_name(0)
    info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    info["memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
print(json.dumps(info))
"""


def cuda_info() -> dict[str, Any]:
    """torch's view of the GPUs, asked in a subprocess (this process never holds a CUDA context)."""
    try:
        done = subprocess.run([PY, "-c", CUDA_PROBE], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return {"available": False, "error": "asking torch about CUDA took over 120 s"}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"available": False, "error": f"cannot import torch: {last}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def driver_version() -> str | None:
    """The NVIDIA driver's version (nvidia-smi), None without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


def loadavg() -> dict[str, float] | None:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return None
    return {"1m": round(one, 2), "5m": round(five, 2), "15m": round(fifteen, 2)}


def machine(cuda: dict[str, Any]) -> dict[str, Any]:
    return {"hostname": platform.node(), "gpu": cuda.get("name"), "gpu_count": cuda.get("count", 0),
            "gpu_memory_bytes": cuda.get("memory_bytes"), "driver": driver_version(), "cuda": cuda.get("cuda"),
            "torch": cuda.get("torch"), "cores": os.cpu_count(), "python": platform.python_version(),
            "kernel": platform.release(), "commd": _commd_version()}


def _commd_version() -> str | None:
    try:
        sys.path.insert(0, str(ROOT))
        from commd import __version__
    except ImportError:
        return None
    return str(__version__)


def find_mpiexec() -> str | None:
    beside = Path(PY).with_name("mpiexec")
    return str(beside) if beside.exists() else shutil.which("mpiexec")


# ---- figures -----------------------------------------------------------------------------------------------
def trim(value: Any) -> Any:
    """The value with long lists of numbers (raw times) replaced by their count, median, min and max."""
    if isinstance(value, dict):
        return {str(k): trim(v) for k, v in value.items()}
    if isinstance(value, list):
        if len(value) > MAX_LIST and all(isinstance(v, int | float) for v in value):
            return {"n": len(value), "median": statistics.median(value), "min": min(value), "max": max(value)}
        return [trim(v) for v in value]
    return value


def read_json(path: Path) -> dict[str, Any]:
    try:
        return trim(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:
        return {"error": f"no figures: {exc}"}


def junit_figures(ctx: Context, out: Path, log: str) -> dict[str, Any]:
    """Per test its outcome (and a skip's or failure's message), and the counts."""
    try:
        root = ET.parse(out).getroot()
    except (OSError, ET.ParseError) as exc:
        return {"error": f"no junit report: {exc}"}
    tests = []
    for case in root.iter("testcase"):
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome, message = {"failure": "failed"}.get(tag, tag), found.get("message")
                break
        tests.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": round(float(case.get("time") or 0), 2), **({"message": message} if message else {})})
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    return {"counts": counts, "tests": tests}


def gpu_test_files() -> list[str]:
    """The test files that hold tests marked gpu (pytest -m gpu then collects only these)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "pytest.mark.gpu" in p.read_text())


# ---- parts -------------------------------------------------------------------------------------------------
def _needs_cuda(ctx: Context) -> str | None:
    if ctx.cuda.get("available"):
        return None
    return NO_CUDA + (f" ({ctx.cuda['error']})" if ctx.cuda.get("error") else "")


def _needs_hosts(ctx: Context) -> str | None:
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces)"
    from commd.sim.hosts import netns_unavailable

    return netns_unavailable()


def _multinode_command(ctx: Context, out: Path) -> list[str]:
    """Its own --quick; every default path, less MPI's without an mpiexec (--quick: tcp and Gloo, 2 sizes)."""
    argv = [PY, str(HERE / "multinode.py"), "--quick", "--json", str(out), "--prefix", "dvcheck"]
    if ctx.quick:
        return argv + ["--links", "unshaped", "--max-bytes", "1M", "--paths", "commd-tcp,gloo"]
    if not ctx.mpiexec:
        argv += ["--paths", "commd-tcp,commd-gloo,torch-commd,gloo"]
    return argv


def _algorithms_command(ctx: Context, out: Path) -> list[str]:
    argv = [PY, str(HERE / "algorithms.py"), "--quick", "--json", str(out)]
    if not ctx.mpiexec:
        argv.append("--no-mpi")
    if ctx.quick:
        argv += ["--settings", "unshaped", "--no-tune", "--max-bytes", "64K"]
    return argv


def _gpu_tests_headline(f: dict[str, Any]) -> str:
    counts = f.get("counts") or {}
    return ", ".join(f"{n} {k}" for k, n in counts.items() if n) or f.get("error", "")


def _ipc_headline(f: dict[str, Any]) -> str:
    rows = f.get("modes", {})
    largest = max((int(b) for b in rows.get("ipc", {}).get("median_us", {})), default=None)
    if largest is None:
        return f.get("error", "")
    cells = [f"{m} {rows[m]['median_us'][str(largest)]:.0f} us" for m in ("ipc", "staged") if m in rows]
    return f"{largest >> 10} KiB all-reduce: " + ", ".join(cells)


def _targets_headline(f: dict[str, Any]) -> str:
    verdicts = [t for v in f.get("verdicts", []) for t in v.get("targets", [])]
    if not verdicts:
        return f.get("error", "")
    met = sum(t["met"] is True for t in verdicts)
    return f"targets {met}/{sum(t['met'] is not None for t in verdicts)} met"


def _multinode_headline(f: dict[str, Any]) -> str:
    checks = [c for s in f.get("settings", {}).values() for c in s.get("targets", [])]
    errors = f.get("errors") or {}
    text = f"targets {sum(bool(c.get('met')) for c in checks)}/{len(checks)} met" if checks else ""
    return text + (f"; {len(errors)} path(s) failed" if errors else "") or f.get("error", "")


PARTS: list[Part] = [
    Part("gpu-tests", True, 60, 240,
         lambda ctx, out: [PY, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={out}",
                           *gpu_test_files()],
         figures=junit_figures, needs=_needs_cuda, headline=_gpu_tests_headline),
    Part("cuda-ipc", True, 30, 150,
         lambda ctx, out: [PY, str(Path(__file__).resolve()), "--probe", "cuda-ipc", "--probe-out", str(out),
                           *(["--quick"] if ctx.quick else [])],
         figures=lambda ctx, out, log: read_json(out), needs=_needs_cuda, headline=_ipc_headline),
    Part("gpu-codecs", True, 40, 180,
         lambda ctx, out: [PY, str(HERE / "gpu_codecs.py"), "--size", "16M" if ctx.quick else "64M",
                           "--rounds", "3" if ctx.quick else "5", "--json", str(out)],
         figures=lambda ctx, out, log: read_json(out), needs=_needs_cuda),
    Part("gpu-allreduce", True, 60, 180,
         lambda ctx, out: [PY, str(HERE / "gpu_allreduce.py"), "--nproc", "2", "--max-bytes",
                           "4M" if ctx.quick else "64M", "--iters", "5" if ctx.quick else "20", "--json", str(out)],
         figures=lambda ctx, out, log: read_json(out), needs=_needs_cuda),
    Part("multinode", False, 120, 300, _multinode_command,
         figures=lambda ctx, out, log: read_json(out), needs=_needs_hosts, headline=_multinode_headline),
    Part("algorithms", False, 180, 420, _algorithms_command,
         figures=lambda ctx, out, log: read_json(out), needs=_needs_hosts, headline=_targets_headline),
]


# ---- running the parts -------------------------------------------------------------------------------------
def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_command(argv: list[str], env: dict[str, str], log: Path, timeout: float) -> tuple[int | None, float]:
    """Run ``argv`` in its own session, output to ``log``; (exit code or None on timeout, seconds).
    On timeout: SIGTERM to its group (benchmarks remove their simulated hosts), SIGKILL after a grace."""
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = None
        _killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    _killpg(proc.pid, signal.SIGKILL)  # whatever its session left behind
    proc.wait()
    return code, time.monotonic() - started


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def part_env(ctx: Context, name: str) -> dict[str, str]:
    """Our environment, this checkout first on PYTHONPATH, a private runtime and tuning directory per part."""
    runtime = ctx.work / f"rt-{name}"
    runtime.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if k not in ("COMMD_JOB", "COMMD_SECRET")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1", COMMD_RUNTIME_DIR=str(runtime), COMMD_TUNING_DIR=str(runtime / "tuning"))
    return env


def run_part(part: Part, ctx: Context, budget_left: float) -> dict[str, Any]:
    """One part's entry: status ok / failed / skipped, the reason, its duration and figures."""
    entry: dict[str, Any] = {"name": part.name, "gpu": part.gpu, "status": "skipped", "reason": None,
                             "duration_s": 0.0, "figures": {}}
    reason = part.needs(ctx)
    if reason is None and budget_left < part.estimate_s:
        reason = (f"over the budget: {budget_left:.0f} s left, and this part takes about {part.estimate_s:.0f} s "
                  "(raise --budget or pick fewer --parts)")
    if reason is not None:
        entry["reason"] = reason
        return entry
    out = ctx.work / f"{part.name}.out"
    log = ctx.work / f"{part.name}.log"
    argv = part.command(ctx, out)
    timeout = min(part.timeout_s, budget_left)
    entry["command"] = [os.path.relpath(a, ROOT) if a.startswith(str(ROOT)) else a.replace(str(ctx.work), "$WORK")
                        for a in argv]
    entry["timeout_s"] = round(timeout, 1)
    code, seconds = run_command(argv, part_env(ctx, part.name), log, timeout)
    entry["duration_s"] = round(seconds, 1)
    entry["figures"] = part.figures(ctx, out, tail(log)) if out.exists() else {}
    if code is None:
        entry.update(status="failed", reason=f"timed out after {timeout:.0f} s (stopped)")
    elif code != 0:
        last = (tail(log, 1) or "no output").strip()
        entry.update(status="failed", reason=f"exit code {code}: {last}")
    else:
        entry["status"] = "ok"
    if entry["status"] == "failed":
        entry["log_tail"] = tail(log)
    entry["headline"] = part.headline(entry["figures"]) if entry["figures"] else ""
    return entry


def run_parts(parts: list[Part], ctx: Context, budget_s: float,
              report: Callable[[dict[str, Any]], None] = lambda entry: None) -> list[dict[str, Any]]:
    """Every part in turn within ``budget_s`` seconds; ``report`` sees each entry as it is done."""
    started = time.monotonic()
    entries = []
    for part in parts:
        entry = run_part(part, ctx, budget_s - (time.monotonic() - started))
        report(entry)
        entries.append(entry)
    return entries


def summary(entries: list[dict[str, Any]]) -> str:
    """The table printed at the end: one line per part."""
    rows = [("part", "status", "seconds", "figures or reason")]
    for e in entries:
        note = e["reason"] if e["status"] != "ok" else e.get("headline") or "see the JSON"
        rows.append((e["name"], e["status"], f"{e['duration_s']:.0f}", note or ""))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}".rstrip() for r in rows)


def check(parts: list[Part], out: Path, quick: bool, budget_s: float) -> tuple[dict[str, Any], int]:
    """The whole check: machine, load, parts; the JSON document and the exit status."""
    date = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    load_start = loadavg()
    started = time.monotonic()
    cuda = cuda_info()
    info = machine(cuda)
    print(f"device check: {info['gpu'] or 'no GPU'} ({_driver_text(info)}), torch {info['torch']}, "
          f"{info['cores']} cores, load {load_start and load_start['1m']}; parts: "
          f"{', '.join(p.name for p in parts)}; budget {budget_s:.0f} s", flush=True)
    work = Path(tempfile.mkdtemp(prefix="commd-device-check-"))
    ctx = Context(quick=quick, work=work, cuda=cuda, mpiexec=find_mpiexec())

    def report(entry: dict[str, Any]) -> None:
        note = entry["reason"] or entry.get("headline") or ""
        print(f"  {entry['name']}: {entry['status']} ({entry['duration_s']:.0f} s){': ' + note if note else ''}",
              flush=True)

    try:
        entries = run_parts(parts, ctx, budget_s - (time.monotonic() - started), report)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    document = {"format": "commd-device-check", "version": 1, "date": date, "machine": info,
                "load": {"start": load_start, "end": loadavg()}, "quick": quick, "budget_s": budget_s,
                "duration_s": round(time.monotonic() - started, 1), "parts": entries}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=1) + "\n")
    print("\n" + summary(entries))
    print(f"\nwrote {out}")
    return document, int(any(e["status"] == "failed" for e in entries))


def _driver_text(info: dict[str, Any]) -> str:
    return f"driver {info['driver'] or 'none'}, CUDA {info['cuda'] or 'none'}"


# ---- the cuda-ipc part's own program ---------------------------------------------------------------------
def probe_cuda_ipc(out: Path, quick: bool, device: str) -> int:
    """A daemon for a fresh job, 2 ranks all-reducing ``device`` tensors per size, first by CUDA IPC then
    staged through host memory (COMMD_CUDA_IPC=0); writes per mode the slowest rank's median per size
    and the daemon's bytes by path.  ``device`` cpu runs the same program on host tensors (the tests)."""
    from commd.client.spawn import start_daemon
    from commd.client.status import query_status
    from commd.runtime import JobPaths

    sizes = [4 << 10, 1 << 20] if quick else [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
    iters = 5 if quick else 20
    job = f"dvcheck{os.getpid()}"
    paths = JobPaths.for_job(job)
    daemon = start_daemon(paths, exit_when_idle=False)
    result: dict[str, Any] = {"device": device, "ranks": 2, "iters": iters, "sizes": sizes, "modes": {}}
    try:
        before = dict(query_status(paths).get("bytes_by_path", {}))
        for mode in ("ipc", "staged"):
            env = dict(os.environ, COMMD_CUDA_IPC="1" if mode == "ipc" else "0")
            ranks = [subprocess.Popen([PY, str(Path(__file__).resolve()), "--probe-rank", str(rank), "--job", job,
                                       "--probe-device", device, "--iters", str(iters),
                                       "--sizes", ",".join(map(str, sizes))],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                     for rank in range(2)]
            outputs = [r.communicate(timeout=120) for r in ranks]
            failed = [f"rank {i}: {err.strip().splitlines()[-1] if err.strip() else 'no output'}"
                      for i, ((_, err), r) in enumerate(zip(outputs, ranks, strict=True)) if r.returncode != 0]
            if failed:
                raise RuntimeError(f"{mode}: " + "; ".join(failed))
            medians = [json.loads(o.strip().splitlines()[-1]) for o, _ in outputs]
            after = dict(query_status(paths).get("bytes_by_path", {}))
            moved = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
            before = after
            result["modes"][mode] = {"median_us": {str(s): max(m[str(s)] for m in medians) for s in sizes},
                                     "bytes_by_path": moved}
        if device == "cuda":
            ipc, staged = (result["modes"][m]["bytes_by_path"] for m in ("ipc", "staged"))
            if not ipc.get("cuda") or staged.get("cuda"):
                raise RuntimeError(f"the paths did not run as asked: ipc moved {ipc}, staged moved {staged}")
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        daemon.terminate()
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
    out.write_text(json.dumps(result, indent=1) + "\n")
    if "error" in result:
        print(result["error"], file=sys.stderr)
        return 1
    return 0


def probe_rank(rank: int, job: str, device_kind: str, sizes: list[int], iters: int) -> int:
    """One rank of the cuda-ipc probe: per size, check one all-reduce, then time ``iters``; prints the
    median microseconds per size as one JSON line."""
    import torch

    from commd.client import Client, ops

    device = torch.device("cuda", 0) if device_kind == "cuda" else torch.device("cpu")
    client = Client(rank, 2, job=job, connect_timeout=60)
    client.register_group("world", [0, 1])
    medians = {}
    for nbytes in sizes:
        t = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
        times = []
        for step in range(iters + 2):  # two untimed: the first exports the storage to the daemon
            t.fill_(float(rank + 1))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            ops.all_reduce(client, t).wait(60)
            elapsed = time.perf_counter() - started
            if step >= 2:
                times.append(elapsed)
        if not bool((t == 3.0).all()):
            raise RuntimeError(f"wrong all-reduce result at {nbytes} B on rank {rank}: {t[:4].tolist()}")
        medians[str(nbytes)] = round(statistics.median(times) * 1e6, 1)
    client.close()
    print(json.dumps(medians), flush=True)
    return 0


# ---- command line ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [p.name for p in PARTS]
    parser.add_argument("--parts", default=",".join(names), help=f"comma-separated subset of {','.join(names)}")
    parser.add_argument("--quick", action="store_true", help="every part as a smoke test (small sizes, few rounds)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help=f"seconds for all parts together (default {DEFAULT_BUDGET_S:.0f})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON of figures (default out/device-check.json)")
    # The cuda-ipc part's own programs (run by this script, not by hand).
    parser.add_argument("--probe", choices=["cuda-ipc"], help=argparse.SUPPRESS)
    parser.add_argument("--probe-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--probe-device", choices=["cuda", "cpu"], default="cuda", help=argparse.SUPPRESS)
    parser.add_argument("--probe-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--iters", type=int, default=20, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.probe_rank is not None:
        return probe_rank(args.probe_rank, args.job, args.probe_device, [int(s) for s in args.sizes.split(",")],
                          args.iters)
    if args.probe:
        return probe_cuda_ipc(args.probe_out, args.quick, args.probe_device)
    chosen = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(chosen) - set(names))
    if unknown or not chosen:
        parser.error(f"--parts: unknown {','.join(unknown) or '(none given)'}; choose from {','.join(names)}")
    if not args.budget > 0:
        parser.error("--budget must be > 0 seconds")
    _, code = check([p for p in PARTS if p.name in chosen], args.out, args.quick, args.budget)
    return code


if __name__ == "__main__":
    sys.exit(main())
