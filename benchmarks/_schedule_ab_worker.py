"""One rank of benchmarks/schedule_ab.py (started under `commd launch` on each simulated host).

Usage: python _schedule_ab_worker.py CONFIG.json

Warms up, then times ``iters`` back-to-back ``dist.all_reduce`` calls of one size on an
ordinary tensor; each node's first rank also reads its rank's and its daemon's CPU time and
context switches around the timed loop, and the daemon's fabric counters and both processes'
resident memory after it; with ``strace`` in the config, rank 0 counts its own and its daemon's
system calls over the timed loop (``strace -c``).  Also run by benchmarks/hosts_scaling.py.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import commd  # noqa: F401  (registers the backend)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _multinode_worker import process_cost  # noqa: E402


def memory_mib(pid: int | str | None) -> dict[str, float] | None:
    """A process's resident memory now and at its peak (``/proc``), in MiB."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except (OSError, TypeError):
        return None
    kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in lines) if k in ("VmRSS", "VmHWM")}
    return {"rss": kib.get("VmRSS", 0) / 1024, "peak": kib.get("VmHWM", 0) / 1024}


def start_strace(pids: dict[str, int | None]) -> dict[str, tuple[subprocess.Popen, Path]]:
    """``strace -c`` attached to each process (every thread), once it says it is attached."""
    tracers = {}
    for who, pid in pids.items():
        if pid is None:
            continue
        out = Path(tempfile.mkstemp(prefix=f"strace-{who}-")[1])
        proc = subprocess.Popen(["strace", "-c", "-f", "-p", str(pid), "-o", str(out)], stderr=subprocess.PIPE,
                                text=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and select.select([proc.stderr], [], [], 1.0)[0]:
            if "attached" in proc.stderr.readline():
                break
        tracers[who] = (proc, out)
    return tracers


def stop_strace(tracers: dict[str, tuple[subprocess.Popen, Path]], ops: int) -> dict[str, dict[str, float]]:
    """Each traced process's system calls per op, by name, from ``strace -c``'s summary."""
    counts: dict[str, dict[str, float]] = {}
    for who, (proc, out) in tracers.items():
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        calls: dict[str, float] = {}
        for line in out.read_text().splitlines():
            fields = line.split()
            if len(fields) >= 5 and fields[0][0].isdigit() and fields[3].isdigit():
                calls[fields[-1]] = int(fields[3]) / ops
        out.unlink()
        counts[who] = calls
    return counts


def main() -> int:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("commd")
    rank = dist.get_rank()
    local_first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    t = torch.ones(cfg["elements"])
    for _ in range(cfg["warmup"]):
        dist.all_reduce(t)
    pid = None
    if local_first:
        from commd.client.status import query_status
        from commd.runtime import JobPaths

        paths = JobPaths.for_job(os.environ["COMMD_JOB"])
        pid = query_status(paths, timeout=10.0)["pid"]
    tracers = start_strace({"daemon": pid, "rank": os.getpid()}) if cfg.get("strace") and rank == 0 else {}
    dist.barrier()
    before, rusage = process_cost(pid), resource.getrusage(resource.RUSAGE_SELF)
    times = []
    for _ in range(cfg["iters"]):
        started = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - started)
    after, rusage_after = process_cost(pid), resource.getrusage(resource.RUSAGE_SELF)
    syscalls = stop_strace(tracers, cfg["iters"])
    dist.barrier()
    iters = cfg["iters"]
    out = {"median_us": sorted(times)[len(times) // 2] * 1e6,
           "rank_cpu_us": (rusage_after.ru_utime + rusage_after.ru_stime - rusage.ru_utime - rusage.ru_stime)
           / iters * 1e6,
           "rank_csw": (rusage_after.ru_nvcsw + rusage_after.ru_nivcsw - rusage.ru_nvcsw - rusage.ru_nivcsw) / iters}
    if local_first:
        fabric = query_status(paths, timeout=10.0).get("fabric") or {}
        out.update({"daemon_cpu_us": (after["daemon_cpu_s"] - before["daemon_cpu_s"]) / iters * 1e6,
                    "daemon_csw": (after["daemon_csw"] - before["daemon_csw"]) / iters,
                    "paths": fabric.get("paths"), "control": fabric.get("control_items"),
                    "schedule": fabric.get("schedule"), "rank_rss_mib": memory_mib("self"),
                    "daemon_rss_mib": memory_mib(pid), "syscalls": syscalls})
    Path(cfg["out"].replace(".json", f"-r{rank}.json")).write_text(json.dumps(out))
    dist.barrier()
    if rank == 0:
        Path(cfg["out"]).write_text(json.dumps({"rank0": cfg["out"].replace(".json", "-r0.json")}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
