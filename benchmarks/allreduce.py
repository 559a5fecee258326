"""all_reduce benchmark: commd against Gloo and MPI on the local ranks of one node.

Measures float32 all_reduce (sum) of N local ranks, for message sizes from
--min-bytes to --max-bytes, through four paths in one run:

  commd        the commd client library on arena tensors (``Client.empty``:
               the zero-copy path), against a daemon started for a fresh job
               in a temporary runtime directory;
  torch-commd  torch.distributed with the "commd" backend on ordinary tensors
               (what DDP users get): up to the exchange ring's largest op
               (4 MiB with 2 ranks, 8 MiB / ranks) the ranks meet in the
               group's shared-memory ring without the daemon; larger tensors
               go to the daemon, staged at their first sighting (from 64 MiB,
               COMMD_REGISTER_FIRST_BYTES, registered at once) and registered
               at their second (the warm-up), so every timed iteration is
               zero-copy — the worker checks that the tensor lives in a memfd;
  torch-commd-daemon
               the same with COMMD_LOCAL_RING=0: every op through the daemon
               (registered after the warm-up; up to 4 KiB inline in the message);
  torch-commd-staged
               COMMD_LOCAL_RING=0 and COMMD_REGISTER=0: every op through the
               daemon, larger tensors staged through the arena (copy in, copy out);
  gloo         torch.distributed with Gloo, directly;
  mpi          mpi4py ``comm.Allreduce(MPI.IN_PLACE, ...)`` under mpiexec;

plus the machine's memory-copy bandwidth (numpy copy of the same size).
Every path runs in its own processes (workers write their per-iteration
times to temp JSON files); this script only orchestrates and reports.

Per size and path: median latency over the timed iterations (per iteration,
the slowest rank's time), algbw = S/t and busbw = algbw * 2(n-1)/n, and the
ratios of commd to Gloo and to MPI.

    python benchmarks/allreduce.py                 # full run (~2-4 min on 2 cores)
    python benchmarks/allreduce.py --quick         # CI smoke test (~30 s)
    python benchmarks/allreduce.py --json out.json --paths commd,mpi
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_allreduce_worker.py"
MPI_WORKER = HERE / "_mpi_allreduce.py"
PATHS = ("commd", "torch-commd", "torch-commd-daemon", "torch-commd-staged", "gloo", "mpi")
#: What each path's rows measure (printed with the report).
PATH_NOTES = {
    "commd": "client library, arena tensors (commd.empty): zero-copy",
    "torch-commd": "torch backend, ordinary tensors: exchange ring up to its largest op, else registered after "
                   "the warm-up (zero-copy)",
    "torch-commd-daemon": "torch backend, ordinary tensors, COMMD_LOCAL_RING=0: through the daemon, inline <= 4 KiB, "
                          "else registered after the warm-up",
    "torch-commd-staged": "torch backend, ordinary tensors, COMMD_LOCAL_RING=0 COMMD_REGISTER=0: through the daemon, "
                          "inline <= 4 KiB, else staged",
    "gloo": "torch backend gloo, ordinary tensors",
    "mpi": "mpi4py Allreduce(IN_PLACE) under mpiexec",
}
ELEMENT = 4  # float32
#: Ratios are also given as latency ratios up to this size (latency-bound regime).
SMALL_BYTES = 64 << 10
#: Targets the product is judged by.
TARGET_BIG_BYTES = 64 << 20
TARGET_VS_MPI = 2.0
TARGET_VS_GLOO = 6.0
TARGET_SMALL_BYTES = 8
TARGET_SMALL_US = 100.0


# ---- plan ------------------------------------------------------------------
def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = 1
    for suffix, factor in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if text.endswith(suffix):
            text, scale = text[:-1], factor
            break
    return int(float(text) * scale)


def human(nbytes: int) -> str:
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor} {unit}"
    return f"{nbytes} B"


def message_sizes(low: int, high: int, factor: int) -> list[int]:
    """Powers of ``factor`` counted down from ``high``, plus ``low`` itself."""
    sizes = set()
    size = high
    while size >= low:
        sizes.add(size)
        size //= factor
    sizes.add(low)
    return sorted(s for s in sizes if s % ELEMENT == 0)


#: How each timed op starts: right after the previous one, or after a barrier of every rank.
STARTS = ("back-to-back", "barrier")


def make_plan(sizes: list[int], iters: int, warmup: int, budget: int, min_iters: int,
              start: str = "back-to-back") -> list[dict]:
    """Fewer iterations for large messages: about ``budget`` bytes per size and path.

    ``start``: "back-to-back" times ops issued one after another (a DDP backward issues its
    buckets so); "barrier" puts a barrier of every rank (untimed) before each timed op, so no
    rank starts with a head start or a backlog (ops separated by compute)."""
    plan = []
    for size in sizes:
        n = max(min_iters, min(iters, budget // size))
        w = max(1, min(warmup, n // 4))
        plan.append({"bytes": size, "iters": n, "warmup": w, "start": start})
    return plan


# ---- processes --------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_group(commands: list[list[str]], env: dict, timeout: float, log: Path) -> None:
    """Run commands concurrently (own session each); kill them all past ``timeout``."""
    procs = []
    with open(log, "ab") as out:
        for cmd in commands:
            procs.append(
                subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                 start_new_session=True)
            )
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            left = deadline - time.monotonic()
            try:
                proc.wait(timeout=max(0.1, left))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"timed out after {timeout:.0f}s") from None
            if proc.returncode != 0:
                raise RuntimeError(f"a process exited with code {proc.returncode}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                _kill_group(proc)
                proc.wait()


def _tail(log: Path, lines: int = 25) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _collect(out_pattern: str, nproc: int) -> list[dict]:
    per_rank = []
    for rank in range(nproc):
        with open(out_pattern.format(rank=rank)) as f:
            per_rank.append(json.load(f))
    return per_rank


def _stop_daemons(runtime: Path) -> None:
    """Stop daemons this run started (their pid files live in our private runtime dir)."""
    for pid_file in runtime.glob("*/daemon.pid"):
        try:
            pid = int(pid_file.read_text().strip())
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"commd" not in f.read():
                    continue  # stale pid file, pid reused by something else
        except (OSError, ValueError):
            continue
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        for _ in range(100):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_path(path: str, args: argparse.Namespace, plan: list[dict], work: Path) -> dict:
    """Run one path in fresh processes; return {"per_rank": [...]} or {"error": ...}."""
    out = str(work / f"{path}-r{{rank}}.json")
    log = work / f"{path}.log"
    runtime = work / f"runtime-{path}"
    runtime.mkdir(mode=0o700)
    env = dict(os.environ)
    env["COMMD_RUNTIME_DIR"] = str(runtime)
    env.pop("COMMD_JOB", None)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["COMMD_REGISTER"] = "0" if path == "torch-commd-staged" else "1"
    env["COMMD_LOCAL_RING"] = "0" if path in ("torch-commd-daemon", "torch-commd-staged") else "1"
    cfg = {
        "path": path, "nproc": args.nproc, "plan": plan, "out": out, "port": free_port(),
        "op_timeout": max(60.0, args.timeout), "job": None,
        "arena_bytes": max(64 << 20, plan[-1]["bytes"] + (1 << 20)),
        "torch_threads": args.torch_threads,
    }
    # A staged torch tensor needs arena room too.
    env["COMMD_ARENA_BYTES"] = str(cfg["arena_bytes"])
    daemon = None
    try:
        if path == "commd":
            # Started here, with the commd API, for a fresh job in our runtime dir
            # (the daemon finds that dir through its environment, copied from ours).
            from commd.client.spawn import start_daemon
            from commd.runtime import JobPaths, new_secret

            cfg["job"] = f"bench-{uuid.uuid4().hex[:8]}"
            saved = os.environ.get("COMMD_RUNTIME_DIR")
            os.environ["COMMD_RUNTIME_DIR"] = str(runtime)
            try:
                daemon = start_daemon(JobPaths(cfg["job"], runtime / cfg["job"]), new_secret(),
                                      exit_when_idle=False, timeout=min(60.0, args.timeout))
            finally:
                if saved is None:
                    os.environ.pop("COMMD_RUNTIME_DIR", None)
                else:
                    os.environ["COMMD_RUNTIME_DIR"] = saved
        cfg_file = work / f"{path}.json"
        cfg_file.write_text(json.dumps(cfg))
        if path == "mpi":
            mpiexec = args.mpiexec or shutil.which("mpiexec", path=str(Path(sys.executable).parent)) \
                or shutil.which("mpiexec")
            if not mpiexec:
                return {"error": "mpiexec not found"}
            commands = [[mpiexec, "-n", str(args.nproc), sys.executable, str(MPI_WORKER), str(cfg_file)]]
        else:
            commands = [[sys.executable, str(WORKER), str(cfg_file), str(r)] for r in range(args.nproc)]
        started = time.monotonic()
        run_group(commands, env, args.timeout, log)
        per_rank = _collect(out, args.nproc)
        return {"per_rank": per_rank, "wall_s": round(time.monotonic() - started, 2)}
    except Exception as exc:  # report the path as failed, run the others
        return {"error": f"{type(exc).__name__}: {exc}\n{_tail(log)}"}
    finally:
        if daemon is not None:
            daemon.terminate()
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        _stop_daemons(runtime)


def memcpy_bound(plan: list[dict]) -> dict[int, float]:
    """Median seconds of a numpy copy of each size."""
    import numpy as np

    out = {}
    for step in plan:
        count = step["bytes"] // ELEMENT
        src = np.ones(count, dtype=np.float32)
        dst = np.empty_like(src)
        for _ in range(step["warmup"]):
            np.copyto(dst, src)
        times = []
        for _ in range(step["iters"]):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            times.append(time.perf_counter() - t0)
        out[step["bytes"]] = statistics.median(times)
    return out


# ---- analysis ---------------------------------------------------------------
def summarize(per_rank: list[dict], nproc: int) -> dict[int, dict]:
    """Per size: median over iterations of the slowest rank's time."""
    factor = 2 * (nproc - 1) / nproc
    rows = {}
    for i, first in enumerate(per_rank[0]["results"]):
        size = first["bytes"]
        iteration_max = [max(ts) for ts in zip(*(r["results"][i]["times"] for r in per_rank), strict=True)]
        t = statistics.median(iteration_max)
        rank0 = statistics.median(first["times"])
        algbw = size / t / 1e9
        rows[size] = {
            "memory": sorted({r["results"][i].get("memory", "?") for r in per_rank}),
            "latency_us": t * 1e6,
            "latency_rank0_us": rank0 * 1e6,
            "p10_us": sorted(iteration_max)[len(iteration_max) // 10] * 1e6,
            "p90_us": sorted(iteration_max)[(len(iteration_max) * 9) // 10] * 1e6,
            "algbw_gbps": algbw,
            "busbw_gbps": algbw * factor if nproc > 1 else algbw,
            "iters": len(iteration_max),
        }
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def analyse(results: dict[str, dict], sizes: list[int]) -> dict[int, dict]:
    ratios = {}
    for size in sizes:
        row = {}
        mine = results.get("commd", {}).get(size)
        for other in ("gloo", "mpi"):
            theirs = results.get(other, {}).get(size)
            if mine and theirs:
                row[f"busbw_commd_over_{other}"] = _ratio(mine["busbw_gbps"], theirs["busbw_gbps"])
                row[f"latency_commd_over_{other}"] = _ratio(mine["latency_us"], theirs["latency_us"])
            torch_commd = results.get("torch-commd", {}).get(size)
            if torch_commd and theirs:
                row[f"busbw_torch_commd_over_{other}"] = _ratio(torch_commd["busbw_gbps"], theirs["busbw_gbps"])
        ratios[size] = row
    return ratios


def check_targets(results: dict[str, dict]) -> list[dict]:
    checks = []
    commd = results.get("commd", {})
    big = commd.get(TARGET_BIG_BYTES)
    for other, want in (("mpi", TARGET_VS_MPI), ("gloo", TARGET_VS_GLOO)):
        theirs = results.get(other, {}).get(TARGET_BIG_BYTES)
        if big and theirs:
            got = big["busbw_gbps"] / theirs["busbw_gbps"]
            checks.append({"target": f"64 MiB commd busbw >= {want:g}x {other}", "value": round(got, 2),
                           "met": got >= want})
    small = commd.get(TARGET_SMALL_BYTES)
    if small:
        checks.append({"target": f"8 B commd median latency <= {TARGET_SMALL_US:g} us",
                       "value": round(small["latency_us"], 1), "met": small["latency_us"] <= TARGET_SMALL_US})
    return checks


# ---- output -----------------------------------------------------------------
def _fmt(value: float | None, spec: str) -> str:
    if value is None:
        return "-"
    if spec == "bw":  # bandwidths span 1e-5 to 1e2 GB/s
        return format(value, ".3f") if value >= 0.01 else format(value, ".2e")
    return format(value, spec)


def print_report(report: dict, stream=sys.stdout) -> None:
    results, sizes, paths = report["results"], report["sizes"], report["paths"]
    memcpy = report["memcpy_gbps"]
    ratios = report["ratios"]
    w = max([12] + [len(p) + 2 for p in paths])
    host = report["host"]
    print(f"\nall_reduce float32 sum, {report['nproc']} local ranks; median over iterations of the "
          f"slowest rank; busbw = algbw * 2(n-1)/n; each op starts {report.get('start', 'back-to-back')}"
          f"{' (after an untimed barrier)' if report.get('start') == 'barrier' else ''}", file=stream)
    print(f"(OMP_NUM_THREADS={host.get('OMP_NUM_THREADS') or 'unset'}, worker torch threads: "
          f"{host.get('torch_threads') or 'default'})", file=stream)
    print("\nlatency (us)", file=stream)
    head = f"{'size':>9} {'iters':>5} " + "".join(f"{p:>{w}}" for p in paths)
    head += f"{'commd/gloo':>{w}}{'commd/mpi':>{w}}"
    print(head, file=stream)
    for size in sizes:
        iters = next((r[size]["iters"] for r in results.values() if size in r), 0)
        line = f"{human(size):>9} {iters:>5} "
        line += "".join(f"{_fmt(results.get(p, {}).get(size, {}).get('latency_us'), '.1f'):>{w}}" for p in paths)
        for other in ("gloo", "mpi"):
            line += f"{_fmt(ratios[size].get(f'latency_commd_over_{other}'), '.2f'):>{w}}"
        print(line, file=stream)
    print("\nbus bandwidth (GB/s)   [memcpy = numpy copy S/t on this machine]", file=stream)
    head = f"{'size':>9} {'memcpy':>{w}}" + "".join(f"{p:>{w}}" for p in paths)
    head += f"{'commd/gloo':>{w}}{'commd/mpi':>{w}}"
    print(head, file=stream)
    for size in sizes:
        line = f"{human(size):>9} {_fmt(memcpy.get(size), 'bw'):>{w}}"
        line += "".join(f"{_fmt(results.get(p, {}).get(size, {}).get('busbw_gbps'), 'bw'):>{w}}" for p in paths)
        for other in ("gloo", "mpi"):
            line += f"{_fmt(ratios[size].get(f'busbw_commd_over_{other}'), '.2f'):>{w}}"
        print(line, file=stream)
    print("\n(commd/X: busbw ratio, >1 means commd is faster; in the latency table t_commd/t_X, "
          "<1 means commd is faster)", file=stream)
    print("\npaths", file=stream)
    for path in paths:
        rows = results.get(path, {})
        memfd = [human(size) for size in sizes if rows.get(size, {}).get("memory") == ["memfd"]]
        seen = f"; tensor in shared memory after the warm-up at: {', '.join(memfd) or 'no size'}" \
            if path.startswith("torch-commd") else ""
        print(f"  {path:<19} {PATH_NOTES.get(path, '')}{seen}", file=stream)
    for path, error in report["errors"].items():
        print(f"\n{path} FAILED: {error}", file=stream)
    if report["targets"]:
        print("\ntargets", file=stream)
        for check in report["targets"]:
            print(f"  [{'met' if check['met'] else 'NOT met'}] {check['target']}: {check['value']}", file=stream)
    load = report["host"].get("loadavg_before"), report["host"].get("loadavg_after")
    print(f"\n(load average before/after: {load[0]} / {load[1]} on {report['host']['cpus']} cpus; "
          "other work on the machine skews small-message latency)", file=stream)
    print(f"(wall time {report['wall_s']:.1f}s; per path: "
          + ", ".join(f"{p} {s}s" for p, s in report["path_wall_s"].items()) + ")", file=stream)


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _str_keys(table: dict) -> dict:
    return {str(k): v for k, v in table.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="local ranks (default 2)")
    parser.add_argument("--min-bytes", type=parse_size, default=8, help="smallest message (default 8)")
    parser.add_argument("--max-bytes", type=parse_size, default=64 << 20, help="largest message (default 64M)")
    parser.add_argument("--factor", type=int, choices=(2, 4), default=4,
                        help="sizes are max-bytes / factor^k, plus min-bytes (default 4)")
    parser.add_argument("--iters", type=int, default=500, help="timed iterations for small messages (default 500)")
    parser.add_argument("--warmup", type=int, default=20, help="warm-up iterations (default 20)")
    parser.add_argument("--budget", type=parse_size, default=1 << 30,
                        help="bytes reduced per size and path, caps iterations of large messages (default 1G)")
    parser.add_argument("--min-iters", type=int, default=8, help="timed iterations at least (default 8)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {','.join(PATHS)}")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds allowed per path (default 240)")
    parser.add_argument("--mpiexec", help="mpiexec to use (default: the one next to this python, else PATH)")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch.set_num_threads in the benchmark's worker processes (default: torch's own)")
    parser.add_argument("--quick", action="store_true", help="a few sizes and iterations (CI smoke test)")
    parser.add_argument("--start", choices=STARTS, default="back-to-back",
                        help="each timed op right after the previous one (default), or after an untimed barrier")
    parser.add_argument("--json", metavar="FILE", help="write every number (and raw times) to FILE")
    parser.add_argument("--keep", action="store_true", help="keep the temp directory (worker logs)")
    args = parser.parse_args(argv)

    if args.nproc < 1:
        parser.error("--nproc must be at least 1")
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = set(paths) - set(PATHS)
    if unknown:
        parser.error(f"unknown paths {sorted(unknown)}; choose from {PATHS}")
    if args.min_bytes < ELEMENT or args.min_bytes > args.max_bytes:
        parser.error("need 4 <= --min-bytes <= --max-bytes")
    if args.quick:
        sizes = sorted({s for s in (8, 64 << 10, 4 << 20) if args.min_bytes <= s <= args.max_bytes}
                       | {args.min_bytes})
        plan = make_plan(sizes, min(args.iters, 50), min(args.warmup, 5), 128 << 20, 4, args.start)
        args.timeout = min(args.timeout, 120.0)
    else:
        sizes = message_sizes(args.min_bytes, args.max_bytes, args.factor)
        plan = make_plan(sizes, args.iters, args.warmup, args.budget, args.min_iters, args.start)
    sizes = [step["bytes"] for step in plan]

    started = time.monotonic()
    load_before = _loadavg()
    work = Path(tempfile.mkdtemp(prefix="commd-bench-"))
    raw: dict[str, list] = {}
    results: dict[str, dict] = {}
    errors: dict[str, str] = {}
    path_wall: dict[str, float] = {}
    try:
        for path in paths:
            print(f"running {path} ...", file=sys.stderr, flush=True)
            outcome = run_path(path, args, plan, work)
            if "error" in outcome:
                errors[path] = outcome["error"]
                print(f"  {path} failed: {outcome['error']}", file=sys.stderr)
                continue
            path_wall[path] = outcome["wall_s"]
            raw[path] = outcome["per_rank"]
            results[path] = summarize(outcome["per_rank"], args.nproc)
        print("measuring memcpy ...", file=sys.stderr, flush=True)
        memcpy_s = memcpy_bound(plan)
    finally:
        if args.keep:
            print(f"worker files kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)

    report = {
        "nproc": args.nproc,
        "start": args.start,
        "sizes": sizes,
        "paths": paths,
        "plan": plan,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                 "loadavg_before": load_before, "loadavg_after": _loadavg(),
                 "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "torch_threads": args.torch_threads},
        "memcpy_gbps": {size: size / t / 1e9 for size, t in memcpy_s.items()},
        "memcpy_us": {size: t * 1e6 for size, t in memcpy_s.items()},
        "results": results,
        "ratios": analyse(results, sizes),
        "targets": check_targets(results),
        "errors": errors,
        "path_wall_s": path_wall,
        "wall_s": time.monotonic() - started,
    }
    print_report(report)
    if args.json:
        out = dict(report)
        for key in ("memcpy_gbps", "memcpy_us", "ratios"):
            out[key] = _str_keys(report[key])
        out["results"] = {p: _str_keys(r) for p, r in results.items()}
        out["raw_times_s"] = {
            p: [{"rank": r["rank"], "results": r["results"]} for r in per_rank] for p, per_rank in raw.items()
        }
        mpi = raw.get("mpi")
        if mpi:
            out["host"]["mpi_library"] = mpi[0].get("library")
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"\nwrote {args.json}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
