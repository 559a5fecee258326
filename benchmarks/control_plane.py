"""The fabric's control plane in one process, at N = 16 ... 8,192 nodes: CPU and messages per op.

No sockets and no lanes.  The op stream is DDP-like: every step the same ``--ops``
all-reduces of one group spanning every node.  Three paths, measured on the code that runs them:

* **negotiated, star** (every node's control link goes to node 0): N members' reports reach the
  coordinator's decision code (``scheduler/coordinator.py``) and the releases come back;
* **negotiated, tree** (``scheduler/tree.py``, fan-out ``--fanout``): relays merge their
  subtree's cached reports into one set and pass the release down.  Both run in
  ``commd.sim.control_plane``, the coordinator and one router per node exchanging real frames
  (msgpack-encoded, decoded again, as the channel would), each node's CPU time measured on its own;
  the busiest process is node 0 on a star, node 0 or a relay on a tree.  What a new pattern, a
  mismatch or a failure takes, and every op of a job that does not repeat itself;
* **scheduled** (``fabric/scheduled.py``): the coordinator is driven until it publishes
  the cycle as a schedule (checked: it does), after which no op reaches it.  Per op each node
  matches its op to the slot (the pattern's cache id) and runs the slot's agreement,
  ``lanes.tcp.algorithms.dissemination_max`` itself, over an in-memory transport that
  hands it the peer's 32 bytes at once: ceil(log2 N) rounds, one message each way per round.
  Every node does the same, so the busiest process is any node.

The first (untimed) step's full reports skip msgpack.  The garbage collector is off while the
model's N daemons run in one heap: a collection would land on whichever node happened to run, and
grow with N for reasons no daemon has (the daemons freeze their old objects; ``COMMD_GC_FREEZE``).

Per N and path: CPU per op of the busiest process (median over the timed steps), the
messages (frames) it handles per op, and the longest chain of messages on an op's critical path
before its data moves.  None of these depend on the core count; the in-memory transport
leaves out the system calls (about 2 x 5 us per message on this machine's loopback).

    python benchmarks/control_plane.py                      # N = 16 ... 8192
    python benchmarks/control_plane.py --nodes 16,1024 --fanout 8 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from typing import Any

from commd.lanes.tcp.algorithms import dissemination_max
from commd.protocol.fabric import Go, OpPattern, Ready, Schedule
from commd.sim.control_plane import ControlPlaneModel

GROUP = "g0"


class EchoTransport:
    """One node's view of the agreement: what it sends is counted, what it receives is there at once
    (a peer's values, the same as its own: the steady state, where every slot agrees)."""

    def __init__(self) -> None:
        self.sent = self.received = 0
        self._last = b""

    def post_send(self, peer: int, view: memoryview, done: Any = None) -> None:
        self._last = bytes(view)  # the copy the socket would make
        self.sent += 1

    def post_recv(self, peer: int, view: memoryview, done: Any = None) -> None:
        view[:] = self._last
        self.received += 1

    def wait(self) -> None:
        return None


def patterns_of(nnodes: int, nbytes: int) -> list[OpPattern]:
    """Every node's full report of an all-reduce of one rank per node (every node of the job); the
    lists of N ranks are one object shared by all N reports (N copies would be N^2 integers)."""
    everyone = list(range(nnodes))
    sig = {"dtype": "float32", "count": nbytes // 4, "reduce_op": "sum"}
    return [OpPattern("allreduce", sig, everyone, everyone, everyone, [node], nbytes, 30.0) for node in everyone]


def run_negotiated(nnodes: int, steps: int, ops: int, nbytes: int, fanout: int) -> dict[str, Any]:
    """Every op through the coordinator (schedules off), its reports and releases on a control tree
    of ``fanout`` (a star when ``fanout >= nnodes - 1``): the figures of the steps after the first."""
    model = ControlPlaneModel(nnodes, fanout, keep_received=False)
    model.coordinator.schedules_on = False
    patterns = patterns_of(nnodes, nbytes)
    cache_ids: list[int] = []
    for index in range(ops):  # the first step: full reports, untimed
        for node in range(nnodes):
            model.report_unencoded(node, Ready(GROUP, index, patterns[node]))
        model.run()
        cache_ids.append(next(m.cache_id for m in model.received[0] if m.seq == index and m.cache_id))
    gc.collect()
    gc.disable()  # N daemons' garbage shares one heap here: a collection would land on whichever node runs
    before = [(c.cpu_ns, c.frames_in + c.frames_out) for c in model.counts]
    cpu_steps: list[list[int]] = []
    for step in range(1, steps + 1):
        at_start = [c.cpu_ns for c in model.counts]
        for index in range(ops):
            for node in range(nnodes):
                model.report(node, [Ready(GROUP, step * ops + index, None, cache_ids[index])])
            model.run()
        cpu_steps.append([c.cpu_ns - a for c, a in zip(model.counts, at_start, strict=True)])
    gc.enable()
    released = model.releases[nnodes - 1]
    if released != (steps + 1) * ops:
        raise RuntimeError(f"N={nnodes}: node {nnodes - 1} received {released} releases, not {(steps + 1) * ops}")
    totals = [c.cpu_ns - b[0] for c, b in zip(model.counts, before, strict=True)]
    busiest = max(range(nnodes), key=totals.__getitem__)
    frames = (model.counts[busiest].frames_in + model.counts[busiest].frames_out - before[busiest][1])
    per_op_cpu = statistics.median(cpu[busiest] for cpu in cpu_steps) / ops / 1000
    return {"nodes": nnodes, "path": "star" if model.tree.is_star else f"tree k={fanout}",
            "cpu_us_per_op": per_op_cpu, "busiest": busiest,
            "busiest_messages_per_op": frames / (steps * ops),
            "node0_items_per_op": (model.counts[0].items_in) / ((steps + 1) * ops),
            "critical_path_messages": 2 * model.tree.depth()}  # reports up the tree, releases down


def run_scheduled(nnodes: int, steps: int, ops: int, nbytes: int) -> dict[str, Any]:
    """Negotiate until the coordinator publishes the step as a schedule, then run ``steps`` steps on it."""
    model = ControlPlaneModel(nnodes, nnodes - 1)
    coordinator = model.coordinator
    patterns = patterns_of(nnodes, nbytes)
    cache_ids: dict[int, int] = {}
    seq = 0
    while not (published := [m for m in model.received[0] if isinstance(m, Schedule)]):
        if seq > 4 * ops + 8:
            raise RuntimeError(f"N={nnodes}: the coordinator published no schedule after {seq} ops")
        index = seq % ops
        for node in range(nnodes):
            if index in cache_ids:
                model.report(node, [Ready(GROUP, seq, None, cache_ids[index])])
            else:
                model.report_unencoded(node, Ready(GROUP, seq, patterns[node]))
        model.run()
        cache_ids.setdefault(index, next(m.cache_id for m in model.received[0] if type(m) is Go and m.seq == seq))
        seq += 1
    schedule = published[0]
    slots = schedule.slots
    received_before = coordinator.stats.coord_items
    # One node's side of each op (every node does the same): the slot's cache id against its op's,
    # then the agreement on (place, cache id).  The key stands for the pattern key a member computes.
    cache = {("op", index % len(slots)): slots[index % len(slots)].cache_id for index in range(len(slots))}
    transport = EchoTransport()
    me, nodes = 0, tuple(range(nnodes))
    packed = memoryview(bytearray(32)).cast("q")
    cpu: list[float] = []
    for step in range(steps):
        started = time.process_time()
        for index in range(ops):
            slot_index = step * ops + index
            slot = slots[slot_index % len(slots)]
            cid = cache[("op", slot_index % len(slots))]
            stamp = slot.cache_id if cid == slot.cache_id else -1
            order = schedule.order + slot_index
            for i, value in enumerate((order, stamp)):
                packed[2 * i], packed[2 * i + 1] = value, -value
            dissemination_max(transport, nodes, me, packed)
            if not (packed[0] == -packed[1] and packed[2] == -packed[3]):
                raise RuntimeError("the agreement failed in the steady state")
        cpu.append(time.process_time() - started)
    if coordinator.stats.coord_items != received_before:
        raise RuntimeError("a scheduled op reached the coordinator")
    timed = steps * ops
    rounds = math.ceil(math.log2(nnodes))
    return {"nodes": nnodes, "path": "scheduled", "cpu_us_per_op": statistics.median(cpu) / ops * 1e6,
            "busiest_messages_per_op": (transport.sent + transport.received) / timed,
            "critical_path_messages": rounds, "coordinator_messages_per_op": 0, "schedule_slots": len(slots)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="16,64,256,1024,4096,8192", help="node counts (comma-separated)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (negotiated: one more, untimed)")
    parser.add_argument("--ops", type=int, default=25, help="all-reduces per step (DDP buckets)")
    parser.add_argument("--bytes", type=int, default=25 << 20, help="bytes per all-reduce (no tiny-op path)")
    parser.add_argument("--fanout", type=int, default=8, help="the control tree's fan-out (the daemons' default: 8)")
    parser.add_argument("--json", metavar="FILE", help="write the figures to FILE")
    args = parser.parse_args(argv)
    try:
        counts = [int(n) for n in args.nodes.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--nodes must be comma-separated integers, not {args.nodes!r}")
    if not counts or min(counts) < 2 or args.steps < 2 or args.ops < 1 or args.fanout < 2:
        parser.error("need node counts >= 2, --steps >= 2, --ops >= 1 and --fanout >= 2")
    load = os.getloadavg()
    rows: list[dict[str, Any]] = []
    print(f"{'N':>6} {'path':<11} {'CPU/op (us)':>12} {'msgs/op':>8} {'2log2N+2':>8} {'critical path':>13}")
    for n in counts:
        runs = [(run_negotiated, (n - 1,)), (run_negotiated, (args.fanout,)), (run_scheduled, ())]
        for run, extra in runs:
            row = run(n, args.steps, args.ops, args.bytes, *extra)
            rows.append(row)
            print(f"{n:>6} {row['path']:<11} {row['cpu_us_per_op']:>12.1f} {row['busiest_messages_per_op']:>8.1f} "
                  f"{2 * math.log2(n) + 2:>8.0f} {row['critical_path_messages']:>13}", flush=True)
    for path in dict.fromkeys(r["path"] for r in rows):
        mine = [r for r in rows if r["path"] == path]
        base = mine[0]
        for row in mine[1:]:
            print(f"{path}: N={row['nodes']} / N={base['nodes']}: CPU per op "
                  f"x{row['cpu_us_per_op'] / base['cpu_us_per_op']:.1f}, messages per op "
                  f"x{row['busiest_messages_per_op'] / base['busiest_messages_per_op']:.1f}")
    print(f"(load average {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after; {args.ops} all-reduces per step, "
          f"{args.steps} timed steps; the busiest process: node 0 on a star, node 0 or a relay on a tree, "
          "any node when scheduled)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "ops": args.ops, "steps": args.steps, "load_before": load,
                       "load_after": os.getloadavg()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
