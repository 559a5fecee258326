"""One rank of an all_reduce benchmark path (started by benchmarks/allreduce.py).

Usage: ``python benchmarks/_allreduce_worker.py CONFIG.json RANK``.  CONFIG
names the path ("commd", "torch-commd", "torch-commd-daemon", "torch-commd-staged" or "gloo"), the world size, the plan
(message size, warm-up and timed iterations for each size) and the file this
rank writes its per-iteration times to.  MPI has its own helper
(_mpi_allreduce.py) because it runs under mpiexec.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import torch

ELEMENT = 4  # float32


def _check(tensor: torch.Tensor, rank: int, n: int, run: Callable[[], None], what: str) -> None:
    """One all_reduce of (rank + 1) everywhere must give n(n+1)/2 everywhere."""
    tensor.fill_(rank + 1)
    run()
    want = n * (n + 1) / 2
    if tensor.numel() and not bool((tensor == want).all()):
        raise SystemExit(f"{what}: wrong all_reduce result on rank {rank}: {tensor[:4].tolist()} != {want}")


def buffer_path(tensor: torch.Tensor) -> str:
    """Where the tensor's memory lives: "memfd" (a commd arena or registered storage) or "private"."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return "memfd" if len(fields) == 6 and fields[5].startswith("/memfd:commd-") else "private"
    return "private"


#: Seconds of all-reduces before the first timed size (see _measure).
START_UP_S = 4.0


def _measure(
    plan: list[dict], rank: int, n: int, make: Callable[[int], torch.Tensor],
    reduce_fn: Callable[[torch.Tensor], None], barrier: Callable[[], None], what: str,
) -> list[dict]:
    results = []
    # The job's first seconds are not its steady state: the daemon imports torch in the background
    # about a second after it starts (2-3 s of a core here), so the first size would time that.
    started, flag = time.monotonic(), make(1)
    while True:  # every rank leaves the loop together: once none of them still warms up
        flag.fill_(1.0 if time.monotonic() - started < START_UP_S else 0.0)
        reduce_fn(flag)
        if flag.item() == 0:
            break
    del flag
    for step in plan:
        nbytes = step["bytes"]
        tensor = make(nbytes // ELEMENT)
        barrier()
        _check(tensor, rank, n, lambda t=tensor: reduce_fn(t), what)  # first sighting of the tensor
        tensor.zero_()  # zeros stay zeros: no overflow over many in-place sums
        for _ in range(step["warmup"]):  # the second sighting registers an ordinary tensor (torch-commd)
            reduce_fn(tensor)
        memory = buffer_path(tensor)  # after the warm-up: the memory every timed iteration uses
        barrier()
        times = []
        clock = time.perf_counter
        from_barrier = step.get("start") == "barrier"
        for _ in range(step["iters"]):
            if from_barrier:
                barrier()
            t0 = clock()
            reduce_fn(tensor)
            times.append(clock() - t0)
        results.append({"bytes": nbytes, "times": times, "memory": memory})
        del tensor
    return results


def run_commd(cfg: dict, rank: int) -> list[dict]:
    """(a) the commd client library on arena tensors (zero-copy)."""
    from commd.client import Client, ops

    n = cfg["nproc"]
    client = Client(rank, n, job=cfg["job"], arena_bytes=cfg["arena_bytes"])
    try:
        client.register_group("world", list(range(n)))
        return _measure(
            cfg["plan"], rank, n,
            make=lambda count: client.empty(count, torch.float32),
            reduce_fn=lambda t: ops.all_reduce(client, t).wait(),
            barrier=lambda: ops.barrier(client).wait(),
            what="commd",
        )
    finally:
        client.close()


def run_torch(cfg: dict, rank: int, backend: str) -> list[dict]:
    """(b) torch.distributed with the "commd" backend, (c) torch's Gloo; ordinary tensors."""
    import torch.distributed as dist

    if backend == "commd":
        import commd  # noqa: F401  (registers the backend)
    n = cfg["nproc"]
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=n,
        timeout=timedelta(seconds=cfg["op_timeout"]),
    )
    try:
        return _measure(
            cfg["plan"], rank, n,
            make=lambda count: torch.empty(count, dtype=torch.float32),
            reduce_fn=lambda t: dist.all_reduce(t),
            barrier=lambda: dist.barrier(),
            what=f"torch.distributed/{backend}",
        )
    finally:
        dist.destroy_process_group()


def main() -> None:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    rank = int(sys.argv[2])
    if cfg.get("torch_threads"):
        torch.set_num_threads(cfg["torch_threads"])
    path = cfg["path"]
    if path == "commd":
        results = run_commd(cfg, rank)
    elif path.startswith("torch-commd"):  # the variants' settings come from the orchestrator's environment
        results = run_torch(cfg, rank, "commd")
    elif path == "gloo":
        results = run_torch(cfg, rank, "gloo")
    else:
        raise SystemExit(f"unknown path {path!r}")
    out = cfg["out"].format(rank=rank)
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"rank": rank, "results": results}, f)
    os.replace(tmp, out)


if __name__ == "__main__":
    main()
