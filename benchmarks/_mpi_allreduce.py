"""MPI all_reduce timings (mpi4py), run by benchmarks/allreduce.py under mpiexec.

Usage: ``mpiexec -n N python benchmarks/_mpi_allreduce.py CONFIG.json``.
Times ``comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)`` on numpy float32
buffers for each step of the plan in CONFIG and writes one JSON file per rank.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI


def main() -> None:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    if n != cfg["nproc"]:
        raise SystemExit(f"mpiexec started {n} ranks, the plan wants {cfg['nproc']}")
    results = []
    for step in cfg["plan"]:
        nbytes = step["bytes"]
        buf = np.empty(nbytes // 4, dtype=np.float32)
        comm.Barrier()
        buf.fill(rank + 1)
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        want = n * (n + 1) / 2
        if buf.size and not (buf == want).all():
            raise SystemExit(f"mpi: wrong all_reduce result on rank {rank}: {buf[:4]} != {want}")
        buf.fill(0)
        for _ in range(step["warmup"]):
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        comm.Barrier()
        times = []
        clock = time.perf_counter
        from_barrier = step.get("start") == "barrier"
        for _ in range(step["iters"]):
            if from_barrier:
                comm.Barrier()
            t0 = clock()
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            times.append(clock() - t0)
        results.append({"bytes": nbytes, "times": times})
    out = cfg["out"].format(rank=rank)
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"rank": rank, "results": results, "library": MPI.Get_library_version().splitlines()[0]}, f)
    os.replace(tmp, out)


if __name__ == "__main__":
    main()
