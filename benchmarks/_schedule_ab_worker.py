"""One rank of benchmarks/schedule_ab.py (started under `commd launch` on each simulated host).

Usage: python _schedule_ab_worker.py CONFIG.json

Warms up, then times ``iters`` back-to-back ``dist.all_reduce`` calls of one size on an
ordinary tensor; each node's first rank also reads its rank's and its daemon's CPU time and
context switches around the timed loop, and the daemon's fabric counters after it.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import commd  # noqa: F401  (registers the backend)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _multinode_worker import process_cost  # noqa: E402


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
    dist.barrier()
    before, rusage = process_cost(pid), resource.getrusage(resource.RUSAGE_SELF)
    times = []
    for _ in range(cfg["iters"]):
        started = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - started)
    after, rusage_after = process_cost(pid), resource.getrusage(resource.RUSAGE_SELF)
    dist.barrier()
    if local_first:
        fabric = query_status(paths, timeout=10.0).get("fabric") or {}
        iters = cfg["iters"]
        out = {"median_us": sorted(times)[len(times) // 2] * 1e6,
               "rank_cpu_us": (rusage_after.ru_utime + rusage_after.ru_stime - rusage.ru_utime - rusage.ru_stime)
               / iters * 1e6,
               "daemon_cpu_us": (after["daemon_cpu_s"] - before["daemon_cpu_s"]) / iters * 1e6,
               "daemon_csw": (after["daemon_csw"] - before["daemon_csw"]) / iters,
               "paths": fabric.get("paths"), "control": fabric.get("control_items")}
        Path(cfg["out"].replace(".json", f"-r{rank}.json")).write_text(json.dumps(out))
        if rank == 0:
            Path(cfg["out"]).write_text(json.dumps({"rank0": cfg["out"].replace(".json", "-r0.json")}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
