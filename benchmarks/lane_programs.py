"""The inter-node phase alone: the tcp lane's all-reduce, natively and by each library program;
with ``--op broadcast``, its broadcast plain and compressed by each codec.

``algorithms.py`` times whole ops (client → daemon → coordinator → lane → client); on a small
machine the fixed cost of an op across nodes (milliseconds of negotiation and process
wake-ups) hides what an algorithm changes.  This benchmark times only what a program
replaces: one ``TcpLane.allreduce`` among N lane processes — the call the daemons make in an
op's inter-node phase —, with ``program=`` each library program or none (``native``: the
lane's own direct/ring algorithms), interleaved per size, each call after a lane barrier.

Per size and algorithm: the median over iterations of the slowest node's time, busbw
(2(n-1)/n · S / t), the ratio to native (> 1: faster), and the CPU time of a node's call
(process time, averaged over nodes: on an oversubscribed machine CPU is time).  The run
is repeated (``--repeats``) and each figure is the median of the repeats.  The issue's
targets, evaluated on this phase:

  T1  some library program >= 1.3x native somewhere in 64 KiB..4 MiB;
  T2  the DSL ring >= 0.9x native at every size >= 1 MiB (the interpreter's own overhead).

    python benchmarks/lane_programs.py                         # 4 nodes on loopback
    python benchmarks/lane_programs.py --sim --rate 10gbit --delay-ms 0.1   # 4 simulated hosts (root)
    python benchmarks/lane_programs.py --sizes 256K,1M --algorithms native,twoshot --repeats 5
    python benchmarks/lane_programs.py --in-process            # the interpreter's own CPU, no sockets

``--in-process`` runs every rank of each program in this one thread over an in-memory
transport (a send is one copy into the matched receive): the CPU per rank and op is then the
interpreter's own work and that copy, free of sockets, wake-ups and the other processes on
the machine — the figure to compare two versions of the interpreter by (best of 5 rounds).

Every result is checked against NumPy (by the workers, ``_lane_worker.py``, and in-process).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from commd.bench.spec import parse_size  # noqa: E402

WORKER = HERE / "_lane_worker.py"
#: Per op: the paths compared by default, the first being the base of the ratios.
DEFAULT_PATHS = {"allreduce": "native,oneshot,twoshot,halving_doubling,ring",
                 "broadcast": "plain,bf16,bf16/per-hop,lossless,lossless/per-hop,bf16-cast"}
BASE_PATH = {"allreduce": "native", "broadcast": "plain"}
T1_RANGE, T1_RATIO = (64 << 10, 4 << 20), 1.3
T2_FROM, T2_RATIO = 1 << 20, 0.9


def human(nbytes: int) -> str:
    for unit, shift in (("M", 20), ("K", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)


def run_once(args: argparse.Namespace, sizes: list[int], algorithms: list[str]) -> dict[str, dict[str, float]]:
    """One run of every cell on fresh lane processes: 'size|algorithm' -> median µs and CPU µs."""
    work = Path(tempfile.mkdtemp(prefix="commd-lanebench-"))
    common = ["--dir", str(work), "--nodes", str(args.nodes), "--op", args.op, "--sizes", ",".join(map(str, sizes)),
              "--algorithms", ",".join(algorithms), "--iters", str(args.iters), "--warmup", str(args.warmup),
              "--timeout", str(args.timeout)]
    procs: list[subprocess.Popen[Any]] = []
    hosts = None
    try:
        if args.sim:
            from commd.sim import SimulatedHosts
            hosts = SimulatedHosts(args.nodes, delay_ms=args.delay_ms, rate=args.rate).up()
            for i, host in enumerate(hosts):
                procs.append(host.popen([sys.executable, str(WORKER), *common, "--node", str(i), "--host", host.ip]))
        else:
            for i in range(args.nodes):
                procs.append(subprocess.Popen([sys.executable, str(WORKER), *common, "--node", str(i)],
                                              start_new_session=True))
        deadline = time.monotonic() + args.timeout * (1 + len(sizes) * len(algorithms))
        for i, proc in enumerate(procs):
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise RuntimeError(f"lane worker {i} exited {code}")
        per_node = [json.loads((work / f"times-{i}.json").read_text()) for i in range(args.nodes)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
        if hosts is not None:
            hosts.down()
    out: dict[str, dict[str, float]] = {}
    for key in per_node[0]:
        slowest = [max(ts) for ts in zip(*(node[key]["times"] for node in per_node), strict=True)]
        out[key] = {"us": statistics.median(slowest) * 1e6,
                    "cpu_us": statistics.mean(node[key]["cpu"][0] for node in per_node) * 1e6}
    return out


class MemoryTransport:
    """One rank's end of an in-memory network: a send is copied into its matched receive at once,
    completions queue up until the driver runs them (``Network.drain``).  ``wait`` is never called."""

    def __init__(self, network: Network, me: int, chunk_bytes: int) -> None:
        self.network, self.me, self.chunk_bytes = network, me, chunk_bytes

    def post_send(self, peer: int, view: memoryview, done: Any = None) -> None:
        self.network.sends[(self.me, peer)].append((view, done))
        self.network.match((self.me, peer))

    def post_recv(self, peer: int, view: memoryview, done: Any = None) -> None:
        self.network.recvs[(peer, self.me)].append((view, done))
        self.network.match((peer, self.me))

    def wait(self) -> None:
        raise RuntimeError("the in-process driver runs completions itself")


class Network:
    """FIFO streams per (sender, receiver) and the completions waiting to run."""

    def __init__(self) -> None:
        self.sends: collections.defaultdict[tuple[int, int], collections.deque[Any]] = \
            collections.defaultdict(collections.deque)
        self.recvs: collections.defaultdict[tuple[int, int], collections.deque[Any]] = \
            collections.defaultdict(collections.deque)
        self.completions: collections.deque[Any] = collections.deque()

    def match(self, stream: tuple[int, int]) -> None:
        sends, recvs = self.sends[stream], self.recvs[stream]
        while sends and recvs:
            (data, sent), (into, received) = sends.popleft(), recvs.popleft()
            into[:] = data
            self.completions.extend(d for d in (sent, received) if d is not None)

    def drain(self) -> None:
        while self.completions:
            self.completions.popleft()()


def in_process(args: argparse.Namespace, sizes: list[int], algorithms: list[str]) -> int:
    """The interpreter's CPU per rank and op: every rank of a program in this thread, no sockets."""
    import numpy as np

    from commd.algorithms import interpreter
    from commd.algorithms.catalog import Catalog
    sys.path.insert(0, str(HERE))
    from _lane_worker import inputs

    catalog = Catalog()
    programs = [a for a in algorithms if a != "native" and not a.startswith("+")]
    n = args.nodes
    print(f"interpreter CPU per rank and op (us), {n} ranks in one thread, in-memory transport, "
          f"best of 5 rounds x {args.iters} ops; load {os.getloadavg()[0]:.2f}")
    print(f"{'size':>6}  " + "".join(f"{p:>18}" for p in programs))
    figures: dict[str, float] = {}
    for size in sizes:
        count = size // 4
        want = sum(inputs(r, count) for r in range(n))
        row = []
        for name in programs:
            program = catalog.get(name, n)
            if isinstance(program, str):
                raise SystemExit(program)
            plans = [interpreter.Plan.build(program.algo, r, count, np.float32, tile_bytes=1 << 20) for r in range(n)]
            arrays = [inputs(r, count) for r in range(n)]

            def once(plans: list[Any] = plans, arrays: list[Any] = arrays) -> None:
                network = Network()
                running = [interpreter.start(plans[r], MemoryTransport(network, r, 1 << 20), list(range(n)),
                                             arrays[r], arrays[r], "sum") for r in range(n)]
                network.drain()
                for r in running:
                    r.finish()

            once()
            if any(not np.array_equal(a, want) for a in arrays):
                raise SystemExit(f"{name} at {size} bytes differs from NumPy's sum")
            best = float("inf")
            for _ in range(5):
                c0 = time.process_time()
                for _ in range(args.iters):
                    once()
                best = min(best, (time.process_time() - c0) / args.iters / n * 1e6)
            figures[f"{size}|{name}"] = best
            row.append(f"{best:18.0f}")
        print(f"{human(size):>6}  " + "".join(row))
    if args.json:
        Path(args.json).write_text(json.dumps({"in_process_cpu_us": figures}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--sizes", default="64K,256K,1M,4M,16M")
    parser.add_argument("--op", choices=("allreduce", "broadcast"), default="allreduce")
    parser.add_argument("--algorithms", help="all-reduce: native, library program names and +CODEC (the ring "
                        "with coded partial results, on model-like data) (default "
                        f"{DEFAULT_PATHS['allreduce']}); broadcast: plain, codecs, CODEC/per-hop (default "
                        f"{DEFAULT_PATHS['broadcast']})")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="whole runs on fresh processes; medians of them")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for one lane call or the connect")
    parser.add_argument("--sim", action="store_true", help="one lane per simulated host (root: network namespaces)")
    parser.add_argument("--rate", help="with --sim: link rate per host and direction, e.g. 10gbit")
    parser.add_argument("--delay-ms", type=float, help="with --sim: one-way link delay")
    parser.add_argument("--in-process", action="store_true",
                        help="the interpreter's own CPU: every rank in this thread, in-memory transport")
    parser.add_argument("--json", metavar="FILE", help="write every figure to FILE")
    args = parser.parse_args(argv)
    if args.nodes < 2:
        parser.error("--nodes: at least 2")
    if (args.rate or args.delay_ms) and not args.sim:
        parser.error("--rate and --delay-ms shape simulated hosts: add --sim")
    if args.sim and os.geteuid() != 0:
        print("benchmarks/lane_programs.py: --sim needs root (network namespaces)", file=sys.stderr)
        return 2
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as exc:
        parser.error(f"--sizes: {exc}")
    if any(s <= 0 or s % 4 for s in sizes):
        parser.error("--sizes: positive multiples of 4 bytes (float32 elements)")
    base = BASE_PATH[args.op]
    algorithms = [a.strip() for a in (args.algorithms or DEFAULT_PATHS[args.op]).split(",") if a.strip()]
    if base not in algorithms:
        algorithms.insert(0, base)
    if args.in_process and args.op != "allreduce":
        parser.error("--in-process measures the interpreter: all-reduce programs only")
    if args.in_process:
        return in_process(args, sizes, algorithms)
    load_before = os.getloadavg()
    runs = [run_once(args, sizes, algorithms) for _ in range(args.repeats)]
    load_after = os.getloadavg()
    cells = {key: {field: statistics.median(r[key][field] for r in runs) for field in ("us", "cpu_us")}
             for key in runs[0]}
    where = (f"{args.nodes} simulated hosts, links {args.rate or 'unshaped'}"
             f"{f' + {args.delay_ms:g} ms' if args.delay_ms else ''}" if args.sim
             else f"{args.nodes} processes on loopback")
    what = "all-reduce (float32 sum)" if args.op == "allreduce" else "broadcast from node 0 (model-like float32)"
    print(f"tcp lane {what}, {where}; median of {args.repeats} runs x {args.iters} iterations; "
          f"load {load_before[0]:.2f} -> {load_after[0]:.2f}")
    print(f"cells: median us of the slowest node [x {base}] (busbw GB/s) cpu us per node")
    width = 38
    print(f"{'size':>6}  " + "".join(f"{a:>{width}}" for a in algorithms))
    n = args.nodes
    for size in sizes:
        base_us = cells[f"{size}|{base}"]["us"]
        row = []
        for a in algorithms:
            c = cells[f"{size}|{a}"]
            busbw = size / (c["us"] / 1e6) * (2 * (n - 1) / n if args.op == "allreduce" else 1) / 1e9
            row.append(f"{c['us']:9.0f} [{base_us / c['us']:4.2f}] ({busbw:5.2f}) cpu {c['cpu_us']:6.0f}")
        print(f"{human(size):>6}  " + "".join(f"{r:>{width}}" for r in row))
    verdicts = []
    t1 = [(cells[f"{s}|native"]["us"] / cells[f"{s}|{a}"]["us"], a, s) for s in sizes for a in algorithms
          if a not in ("native", "ring") and not a.startswith("+") and T1_RANGE[0] <= s <= T1_RANGE[1]
          and args.op == "allreduce"]
    if t1:
        best = max(t1)
        verdicts.append(("T1 program >= 1.3x native, 64K-4M (lane phase)", best[0] >= T1_RATIO,
                         f"best {best[1]} at {human(best[2])}: {best[0]:.2f}x"))
    if "ring" in algorithms and args.op == "allreduce":
        t2 = [(cells[f"{s}|native"]["us"] / cells[f"{s}|ring"]["us"], s) for s in sizes if s >= T2_FROM]
        if t2:
            worst = min(t2)
            verdicts.append(("T2 DSL ring >= 0.9x native, >= 1M (lane phase)", worst[0] >= T2_RATIO,
                             f"worst {worst[0]:.2f}x at {human(worst[1])}"))
    for name, met, evidence in verdicts:
        print(f"  {name:<50} {'met' if met else 'NOT met':<8} {evidence}")
    if args.json:
        Path(args.json).write_text(json.dumps({"where": where, "load": [load_before, load_after], "cells": cells,
                                               "runs": runs, "verdicts": verdicts}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
