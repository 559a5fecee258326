"""A batch of small isend/irecv pairs: one message to the daemon, or one per op, against Gloo.

Every rank posts ``--pairs`` receives from and ``--pairs`` sends to each other rank
(``--elements`` float32 each, small enough to travel inline), receives first, and waits
for them all, in three ways, interleaved in every round (the machine's load drifts):

  commd batched     ``commd.batch_isend_irecv``: the batch reaches the daemon as one message
  commd one by one  ``dist.batch_isend_irecv`` on the commd group (torch sends op by op there)
  gloo              ``dist.batch_isend_irecv`` on a Gloo group of the same ranks

Per way: the median over iterations of the slowest rank's time for one batch, and its
ratio to the batched time; with the machine's load average and core count.  Every way's
received tensors are checked against what the peers sent before anything is timed.

    python benchmarks/batch_p2p.py [--pairs 16] [--elements 64] [--iters 200] [--rounds 3] [--world 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

WAYS = ("commd batched", "commd one by one", "gloo")


def _ops(rank: int, world: int, pairs: int, elements: int, group: object) -> tuple[list, list]:
    import torch
    import torch.distributed as dist

    peers = [p for p in range(world) if p != rank]
    received = [torch.zeros(elements) for _ in peers for _ in range(pairs)]
    recvs = [dist.P2POp(dist.irecv, received[i * pairs + k], p, group=group)
             for i, p in enumerate(peers) for k in range(pairs)]
    sends = [dist.P2POp(dist.isend, torch.full((elements,), float(1000 * rank + 10 * p + k)), p, group=group)
             for p in peers for k in range(pairs)]
    return recvs + sends, received


def _run(way: str, p2p: list) -> None:
    import torch.distributed as dist

    import commd

    works = commd.batch_isend_irecv(p2p) if way == "commd batched" else dist.batch_isend_irecv(p2p)
    for work in works:
        work.wait()


def worker(rank: int, cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    import commd  # noqa: F401 - registers the backend

    world, pairs, elements = cfg["world"], cfg["pairs"], cfg["elements"]
    dist.init_process_group("commd", init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    gloo = dist.new_group(backend="gloo")
    groups = {"commd batched": dist.group.WORLD, "commd one by one": dist.group.WORLD, "gloo": gloo}
    peers = [p for p in range(world) if p != rank]
    for way in WAYS:  # correctness first, and warm-up
        for _ in range(cfg["warmup"]):
            p2p, received = _ops(rank, world, pairs, elements, groups[way])
            _run(way, p2p)
        for i, p in enumerate(peers):
            for k in range(pairs):
                want = float(1000 * p + 10 * rank + k)
                assert torch.all(received[i * pairs + k] == want), f"{way}: rank {rank} got wrong data from {p}"
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(cfg["rounds"]):
        for way in WAYS:
            batches = [_ops(rank, world, pairs, elements, groups[way])[0] for _ in range(cfg["iters"])]
            for p2p in batches:
                dist.barrier(group=gloo)
                start = time.perf_counter()
                _run(way, p2p)
                times[way].append(time.perf_counter() - start)
    # the slowest rank's time per iteration
    mine = torch.tensor([t for way in WAYS for t in times[way]], dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=gloo)
    if rank == 0:
        slowest = torch.stack(everyone).max(dim=0).values.tolist()
        per_way = len(slowest) // len(WAYS)
        result = {way: slowest[i * per_way:(i + 1) * per_way] for i, way in enumerate(WAYS)}
        Path(cfg["out"]).write_text(json.dumps(result))
    dist.barrier(group=gloo)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=16, help="sends to (and receives from) each peer per batch")
    parser.add_argument("--elements", type=int, default=64, help="float32 elements per tensor")
    parser.add_argument("--iters", type=int, default=200, help="timed batches per way and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import torch.multiprocessing as mp

    from commd.runtime import free_port

    with tempfile.TemporaryDirectory(prefix="commd-batchp2p-") as tmp:
        os.environ.update(COMMD_RUNTIME_DIR=tmp, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        os.environ.pop("COMMD_JOB", None)
        cfg = {**vars(args), "out": str(Path(tmp) / "times.json")}
        load = os.getloadavg()
        mp.spawn(worker, args=(cfg,), nprocs=args.world)
        times = json.loads(Path(cfg["out"]).read_text())
    medians = {way: statistics.median(times[way]) for way in WAYS}
    ops = 2 * args.pairs * (args.world - 1)
    print(f"{args.world} ranks, {ops} ops per rank per batch ({args.pairs} isend + {args.pairs} irecv per peer, "
          f"{args.elements} float32 each); {args.iters} x {args.rounds} batches per way; "
          f"load average {load[0]:.2f} before / {os.getloadavg()[0]:.2f} after, {os.cpu_count()} cores")
    print(f"{'way':<18} {'median us/batch':>16} {'us/op':>8} {'/ batched':>10}")
    for way in WAYS:
        m = medians[way]
        print(f"{way:<18} {m * 1e6:16.1f} {m * 1e6 / ops:8.2f} {m / medians['commd batched']:10.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "medians_s": medians, "load": load}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
