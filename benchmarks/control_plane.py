"""The fabric's control plane in one process, at N = 16 ... 8,192 nodes: CPU and messages per op.

No sockets and no lanes.  The op stream is DDP-like: every step the same ``--ops``
all-reduces of one group spanning every node.  Two paths, measured on the code that runs them:

* **negotiated** (what every op took before the schedule path, and what a new pattern, a
  mismatch or a failure still takes): N members' reports go to the coordinator's decision
  code (``scheduler/coordinator.py``, which does no I/O) as the typed messages of
  ``protocol/fabric.py``, each encoded to msgpack and decoded again as the channel would,
  and the releases come back the same way.  The busiest process is node 0.
* **scheduled** (``fabric/scheduled.py``): the coordinator is driven until it publishes
  the cycle as a schedule (checked: it does), after which no op reaches it.  Per op each node
  matches its op to the slot (the pattern's cache id) and runs the slot's agreement,
  ``lanes.tcp.algorithms.dissemination_max`` itself, over an in-memory transport that
  hands it the peer's 32 bytes at once: ceil(log2 N) rounds, one message each way per round.
  Every node does the same, so the busiest process is any node.

The first (untimed) step's full reports skip msgpack, and what it built is frozen out of the
garbage collector's walks (``gc.freeze``), as a long-running daemon's old objects mostly are.

Per N and path: CPU per op of the busiest process (median over the timed steps), the
messages it handles per op, and the longest chain of messages on an op's critical path
before its data moves.  None of these depend on the core count; the in-memory transport
leaves out the system calls (about 2 x 5 us per message on this machine's loopback).

    python benchmarks/control_plane.py                      # N = 16 ... 8192
    python benchmarks/control_plane.py --nodes 16,1024 --json out.json
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

import msgpack

from commd.lanes.tcp.algorithms import dissemination_max
from commd.protocol.fabric import OpPattern, Ready, Schedule
from commd.scheduler.config import SchedulerConfig
from commd.scheduler.coordinator import Coordinator, Outbox

GROUP = "g0"


class AnyLane:
    """A lane that can run every op (selection is not what is measured)."""

    def can_run(self, *args: Any) -> None:
        return None


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


def negotiate_step(coordinator: Coordinator, nnodes: int, ops: int, first_seq: int, cache_ids: dict[int, int],
                   patterns: list[OpPattern], packer: msgpack.Packer) -> tuple[int, int, list[Schedule]]:
    """One step through the coordinator; (messages in, messages out, schedules published)."""
    messages_in = messages_out = 0
    published: list[Schedule] = []
    for index in range(ops):
        seq = first_seq + index
        out = Outbox()
        cid = cache_ids.get(index)
        for node in range(nnodes):
            if cid is None:  # a full report (the first step, not timed): no trip through msgpack, whose
                coordinator.report(node, [Ready(GROUP, seq, patterns[node])], out)  # N-long lists cost N^2
            else:
                frame = packer.pack([Ready(GROUP, seq, None, cid).to_wire()])  # the member's encoding
                item = msgpack.unpackb(frame, raw=False)[0]  # the coordinator's decoding
                coordinator.report(node, [Ready.from_wire(item)], out)
            messages_in += 1
        for _node, messages in out.messages.items():
            frame = packer.pack([m.to_wire() for m in messages])
            messages_out += 1
            decoded = msgpack.unpackb(frame, raw=False)
            if cid is None:
                cache_ids[index] = decoded[0]["c"]
            published += [m for m in messages if isinstance(m, Schedule)]
    return messages_in, messages_out, published


def run_negotiated(nnodes: int, steps: int, ops: int, nbytes: int) -> dict[str, Any]:
    """Every op through the coordinator (schedules off): the figures of the steps after the first."""
    coordinator = Coordinator(nnodes, SchedulerConfig(), {"tcp": AnyLane()})
    coordinator.schedules_on = False
    packer = msgpack.Packer(use_bin_type=True)
    cache_ids: dict[int, int] = {}
    patterns = patterns_of(nnodes, nbytes)
    cpu: list[float] = []
    messages = 0
    for step in range(steps):
        if step == 1:  # what the first step built stays: the collector need not walk it again and again
            gc.collect()
            gc.freeze()
        started = time.process_time()
        received, sent, _ = negotiate_step(coordinator, nnodes, ops, step * ops, cache_ids, patterns, packer)
        if step > 0:
            cpu.append(time.process_time() - started)
            messages += received + sent
    gc.unfreeze()
    return {"nodes": nnodes, "path": "negotiated", "cpu_us_per_op": statistics.median(cpu) / ops * 1e6,
            "busiest_messages_per_op": messages / ((steps - 1) * ops),
            "critical_path_messages": 2}  # a node's report to node 0, node 0's release back


def run_scheduled(nnodes: int, steps: int, ops: int, nbytes: int) -> dict[str, Any]:
    """Negotiate until the coordinator publishes the step as a schedule, then run ``steps`` steps on it."""
    coordinator = Coordinator(nnodes, SchedulerConfig(), {"tcp": AnyLane()})
    packer = msgpack.Packer(use_bin_type=True)
    cache_ids: dict[int, int] = {}
    patterns = patterns_of(nnodes, nbytes)
    seq, published = 0, []
    while not published:
        if seq > 4 * ops + 8:
            raise RuntimeError(f"N={nnodes}: the coordinator published no schedule after {seq} ops")
        _, _, published = negotiate_step(coordinator, nnodes, 1, seq, cache_ids, patterns, packer)
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
    parser.add_argument("--steps", type=int, default=4, help="timed steps (negotiated: one more, untimed)")
    parser.add_argument("--ops", type=int, default=100, help="all-reduces per step (DDP buckets)")
    parser.add_argument("--bytes", type=int, default=25 << 20, help="bytes per all-reduce (no tiny-op path)")
    parser.add_argument("--json", metavar="FILE", help="write the figures to FILE")
    args = parser.parse_args(argv)
    try:
        counts = [int(n) for n in args.nodes.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--nodes must be comma-separated integers, not {args.nodes!r}")
    if not counts or min(counts) < 2 or args.steps < 2 or args.ops < 1:
        parser.error("need node counts >= 2, --steps >= 2 and --ops >= 1")
    load = os.getloadavg()
    rows: list[dict[str, Any]] = []
    print(f"{'N':>6} {'path':<11} {'CPU/op (us)':>12} {'msgs/op':>8} {'2log2N+2':>8} {'critical path':>13}")
    for n in counts:
        for run in (run_negotiated, run_scheduled):
            row = run(n, args.steps, args.ops, args.bytes)
            rows.append(row)
            print(f"{n:>6} {row['path']:<11} {row['cpu_us_per_op']:>12.1f} {row['busiest_messages_per_op']:>8.0f} "
                  f"{2 * math.log2(n) + 2:>8.0f} {row['critical_path_messages']:>13}", flush=True)
    for path in ("negotiated", "scheduled"):
        mine = [r for r in rows if r["path"] == path]
        base = mine[0]
        for row in mine[1:]:
            print(f"{path}: N={row['nodes']} / N={base['nodes']}: CPU per op "
                  f"x{row['cpu_us_per_op'] / base['cpu_us_per_op']:.1f}, messages per op "
                  f"x{row['busiest_messages_per_op'] / base['busiest_messages_per_op']:.1f}")
    print(f"(load average {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after; {args.ops} all-reduces per step, "
          f"{args.steps} timed steps; the busiest process: node 0 when negotiated, any node when scheduled)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "ops": args.ops, "steps": args.steps, "load_before": load,
                       "load_after": os.getloadavg()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
