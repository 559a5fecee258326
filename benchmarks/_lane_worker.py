"""One node of ``lane_programs.py``: a tcp lane, timing its all-reduce natively and by program.

Started once per node (on loopback or in a simulated host) with the run's directory: it
publishes its endpoint there, waits for everyone's, connects, then times every (size,
algorithm) cell in the order given (the same on every node: lane calls must match) and
writes ``times-<node>.json``.  Each timed call follows a lane barrier; its result is checked
against NumPy (small integers in float32: every summation order gives the same bits).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from commd.algorithms.catalog import Catalog, Chosen  # noqa: E402
from commd.lanes.tcp.lane import TcpLane  # noqa: E402

SECRET = "lane-programs-benchmark"


def inputs(node: int, count: int) -> np.ndarray:
    """Node ``node``'s input: small integers, so a float32 sum is exact whatever the order."""
    return np.random.default_rng(1000 + node).integers(-8, 8, count).astype(np.float32)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--node", type=int, required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--sizes", required=True, help="bytes, comma-separated")
    parser.add_argument("--algorithms", required=True, help="native and program names, comma-separated")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(args.dir)
    lane = TcpLane(args.node, args.nodes, SECRET, args.host)
    (work / f"ep-{args.node}.tmp").write_text(json.dumps(list(lane.endpoint)))
    (work / f"ep-{args.node}.tmp").rename(work / f"ep-{args.node}.json")
    deadline = time.monotonic() + args.timeout
    while not all((work / f"ep-{i}.json").exists() for i in range(args.nodes)):
        if time.monotonic() > deadline:
            raise SystemExit(f"node {args.node}: the other nodes' endpoints did not appear in {args.timeout:g} s")
        time.sleep(0.02)
    endpoints = [tuple(json.loads((work / f"ep-{i}.json").read_text())) for i in range(args.nodes)]
    lane.connect(endpoints, args.timeout)
    nodes = tuple(range(args.nodes))
    catalog = Catalog()
    results: dict[str, dict[str, list[float]]] = {}
    for nbytes in (int(s) for s in args.sizes.split(",")):
        count = nbytes // 4
        mine = torch.from_numpy(inputs(args.node, count))
        want = sum(inputs(n, count) for n in nodes)
        buf = torch.empty(count, dtype=torch.float32)
        for name in args.algorithms.split(","):
            chosen = None
            if name != "native":
                program = catalog.get(name, args.nodes)
                if isinstance(program, str):
                    raise SystemExit(f"node {args.node}: {program}")
                chosen = Chosen(name, program.digest, program)
            times, cpu = [], 0.0
            for it in range(args.warmup + args.iters):
                buf.copy_(mine)
                lane.barrier(nodes, args.timeout)
                c0, t0 = time.process_time(), time.perf_counter()
                lane.allreduce(nodes, buf, "sum", args.timeout, program=chosen)
                t, c = time.perf_counter() - t0, time.process_time() - c0
                if it == 0 and not np.array_equal(buf.numpy(), want):
                    raise SystemExit(f"node {args.node}: {name} at {nbytes} bytes differs from NumPy's sum")
                if it >= args.warmup:
                    times.append(t)
                    cpu += c
            results[f"{nbytes}|{name}"] = {"times": times, "cpu": [cpu / args.iters]}
    (work / f"times-{args.node}.json").write_text(json.dumps(results))
    lane.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
