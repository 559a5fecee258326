"""One node of ``lane_programs.py``: a tcp lane, timing its all-reduce (natively and by program)
or its broadcast (plain, and compressed by each codec).

Started once per node (on loopback or in a simulated host) with the run's directory: it
publishes its endpoint there, waits for everyone's, connects, then times every (size,
algorithm) cell in the order given (the same on every node: lane calls must match) and
writes ``times-<node>.json``.  Each timed call follows a lane barrier; its result is checked
against NumPy (small integers in float32: every summation order gives the same bits).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from commd.algorithms.catalog import Catalog, Chosen  # noqa: E402
from commd.codecs import get as get_codec  # noqa: E402
from commd.lanes.tcp.lane import TcpLane  # noqa: E402

SECRET = "lane-programs-benchmark"


def inputs(node: int, count: int) -> np.ndarray:
    """Node ``node``'s input: small integers, so a float32 sum is exact whatever the order."""
    return np.random.default_rng(1000 + node).integers(-8, 8, count).astype(np.float32)


Cell = tuple[Callable[[], None], Callable[[], None], Callable[[], bool]]


@functools.cache
def catalog() -> Catalog:
    return Catalog()


def allreduce_cell(lane: TcpLane, nodes: tuple[int, ...], node: int, nbytes: int, name: str, timeout: float) -> Cell:
    """(call, prepare, check) of one all-reduce cell: ``name`` is native, a library program, or
    ``+CODEC`` (the lane's ring with coded partial results, on model-like data, checked against the
    exact sum within one rounding of the codec per hop)."""
    count = nbytes // 4
    if name.startswith("+"):
        codec = get_codec(name[1:])
        data = [torch.from_numpy(weights(count, seed=n)) for n in nodes]
        exact = torch.stack([d.double() for d in data]).sum(0)
        rel = max(codec.error_bound("float32")[0], 2.0 ** -23)  # (float32 sums round too)
        slack = len(nodes) * rel * torch.stack([d.double().abs() for d in data]).sum(0)
        buf = torch.empty(count, dtype=torch.float32)
        return (lambda: lane.allreduce(nodes, buf, "sum", timeout, codec=codec), lambda: buf.copy_(data[node]),
                lambda: bool(((buf.double() - exact).abs() <= slack).all()))
    mine = torch.from_numpy(inputs(node, count))
    want = sum(inputs(n, count) for n in nodes)
    buf = torch.empty(count, dtype=torch.float32)
    chosen = None
    if name != "native":
        program = catalog().get(name, len(nodes))
        if isinstance(program, str):
            raise SystemExit(f"node {node}: {program}")
        chosen = Chosen(name, program.digest, program)
    return (lambda: lane.allreduce(nodes, buf, "sum", timeout, program=chosen), lambda: buf.copy_(mine),
            lambda: np.array_equal(buf.numpy(), want))


def weights(count: int, seed: int = 7) -> np.ndarray:
    """Model-like float32 data: N(0, 0.02) with one value in 97 a hundred times larger."""
    values = (np.random.default_rng(seed).standard_normal(count) * 0.02).astype(np.float32)
    values[::97] *= 100
    return values


def broadcast_cell(lane: TcpLane, nodes: tuple[int, ...], node: int, nbytes: int, name: str, timeout: float) -> Cell:
    """(call, prepare, check) of one broadcast cell from node 0: ``name`` is ``plain`` (the lane's
    chain), a codec, or ``CODEC/per-hop`` (the baseline that decodes and codes again at each hop)."""
    codec_name, _, variant = name.partition("/")
    codec = None if codec_name == "plain" else get_codec(codec_name)
    source = torch.from_numpy(weights(nbytes // 4))
    rounding = {"bf16": torch.bfloat16, "bf16-cast": torch.bfloat16, "fp16": torch.float16}.get(codec_name)
    want = source.to(rounding).to(torch.float32) if rounding is not None and codec is not None else source
    buf = torch.empty_like(source)
    return (lambda: lane.broadcast(nodes, buf, 0, timeout, codec=codec, per_hop=variant == "per-hop"),
            lambda: buf.copy_(source) if node == 0 else buf.fill_(0.0),
            lambda: buf.numpy().tobytes() == want.numpy().tobytes())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--node", type=int, required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--sizes", required=True, help="bytes, comma-separated")
    parser.add_argument("--op", choices=("allreduce", "broadcast"), default="allreduce")
    parser.add_argument("--algorithms", required=True,
                        help="all-reduce: native and program names; broadcast: plain, codecs, CODEC/per-hop")
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
    results: dict[str, dict[str, list[float]]] = {}
    for nbytes in (int(s) for s in args.sizes.split(",")):
        for name in args.algorithms.split(","):
            call, prepare, check = (allreduce_cell if args.op == "allreduce" else broadcast_cell)(
                lane, nodes, args.node, nbytes, name, args.timeout)
            times, cpu = [], 0.0
            for it in range(args.warmup + args.iters):
                prepare()
                lane.barrier(nodes, args.timeout)
                c0, t0 = time.process_time(), time.perf_counter()
                call()
                t, c = time.perf_counter() - t0, time.process_time() - c0
                if it == 0 and not check():
                    raise SystemExit(f"node {args.node}: {args.op} {name} at {nbytes} bytes differs from the reference")
                if it >= args.warmup:
                    times.append(t)
                    cpu += c
            results[f"{nbytes}|{name}"] = {"times": times, "cpu": [cpu / args.iters]}
    (work / f"times-{args.node}.json").write_text(json.dumps(results))
    lane.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
