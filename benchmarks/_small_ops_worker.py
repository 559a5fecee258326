"""One rank of the small-op throughput benchmark (started by benchmarks/small_ops.py under `commd launch`).

Usage: python _small_ops_worker.py CONFIG.json

Every rank issues ``ops`` asynchronous float32 all-reduces of the configured
sizes, at most ``window`` in flight, each in flight op on its own arena tensor
(a tensor is reused only after its previous op completed, as a training step's
gradient buckets are).  Rank 0 writes ops/s (collective ops completed per
second) to the result file; the first op of each size is checked.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time

import torch

from commd.client import Client, ops


def burst(client: Client, pool: list[torch.Tensor], count: int, window: int, timeout: float) -> None:
    """``count`` async all-reduces, at most ``window`` in flight, op i on pool[i % len(pool)]."""
    in_flight: collections.deque = collections.deque()
    for i in range(count):
        if len(in_flight) >= window:
            in_flight.popleft().wait(timeout)
        in_flight.append(ops.all_reduce(client, pool[i % len(pool)]))
    while in_flight:
        in_flight.popleft().wait(timeout)


def main() -> int:
    cfg = json.loads(open(sys.argv[1]).read())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    nodes = cfg["nodes"] if len(set(cfg["nodes"])) > 1 else None
    client = Client(rank, world, local_rank=int(os.environ["LOCAL_RANK"]), job=os.environ["COMMD_JOB"],
                    nodes=nodes, op_timeout=cfg["timeout"])
    client.register_group("world", list(range(world)))
    timeout = cfg["timeout"]
    results = []
    try:
        for nbytes in cfg["sizes"]:
            count = max(1, nbytes // 4)
            pool = [client.empty(count, torch.float32) for _ in range(2 * cfg["window"])]
            pool[0].fill_(rank + 1)
            ops.all_reduce(client, pool[0]).wait(timeout)
            want = world * (world + 1) / 2
            if not bool((pool[0] == want).all()):
                raise SystemExit(f"rank {rank}: wrong all_reduce result at {nbytes} B: {pool[0][:4].tolist()}")
            for t in pool:
                t.zero_()
            burst(client, pool, cfg["warmup_ops"], cfg["window"], timeout)  # untimed: the same path, warm
            ops.barrier(client).wait(timeout)
            started = time.perf_counter()
            burst(client, pool, cfg["ops"], cfg["window"], timeout)
            elapsed = time.perf_counter() - started
            results.append({"bytes": nbytes, "ops": cfg["ops"], "seconds": elapsed, "ops_per_s": cfg["ops"] / elapsed})
            ops.barrier(client).wait(timeout)
        if rank == 0:
            from commd.client.status import query_status
            from commd.runtime import JobPaths

            status = query_status(JobPaths.for_job(os.environ["COMMD_JOB"]), timeout=10.0)
            fabric = status.get("fabric") or {}
            with open(cfg["out"], "w") as f:
                json.dump({"rows": results, "fusion": fabric.get("fusion")}, f)
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
