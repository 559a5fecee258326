"""The torch backend across 2 simulated hosts x 2 ranks, schedule path on and off, interleaved.

Each run is one job under `commd launch` (COMMD_LOCAL_RING=0: every op through the
daemons) that times back-to-back ``dist.all_reduce`` calls of one size on ordinary float32
tensors.  For each size, ``--repeats`` runs with the schedule path (the default) alternate
with as many with ``COMMD_SCHEDULE=0`` (every op negotiated through node 0), so the load's
drift falls on both alike; ``--settings ring`` adds the torch backend's default path (small
all-reduces on the bridged exchange ring, COMMD_LOCAL_RING=1) bridged by each node's first rank
(COMMD_RING_BRIDGE=rank), and ``ring-daemon`` the same ring bridged by the daemons (the default).  ``--syscalls`` counts node 0's daemon's
and first rank's system calls per op (``strace -c``, which slows them); ``--trace`` traces every op (COMMD_TRACE) and
prints the median of each of the daemons' phases per node (submit, schedule or negotiate, queue,
agree, lane or its steps local, wire and out, reply: docs/observability.md).  Per run: the slower
node's median latency; the CPU per op summed over the job's processes (2 daemons, 4 ranks); the
daemons' and the ranks' context switches per op (each process's mean); ops per path.  Needs root.

    sudo .venv/bin/python benchmarks/schedule_ab.py                       # 1 KiB, 64 KiB, 1 MiB; 3 each
    sudo .venv/bin/python benchmarks/schedule_ab.py --sizes 1K --repeats 5
    sudo .venv/bin/python benchmarks/schedule_ab.py --sizes 1K --repeats 1 --iters 2000 --syscalls
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from _launch import run_job

from commd.runtime import new_secret, parse_bytes

WORKER = Path(__file__).with_name("_schedule_ab_worker.py")
#: Each setting's environment: the schedule path, every op negotiated, and the torch backend's
#: default (small all-reduces on the bridged exchange ring, the rest on the schedule path), with
#: the ring's bridge played by each node's first rank or by the daemon (the default).
SETTINGS = {"schedule": {"COMMD_LOCAL_RING": "0", "COMMD_SCHEDULE": "1"},
            "negotiated": {"COMMD_LOCAL_RING": "0", "COMMD_SCHEDULE": "0"},
            "ring": {"COMMD_LOCAL_RING": "1", "COMMD_SCHEDULE": "1", "COMMD_RING_BRIDGE": "rank"},
            "ring-daemon": {"COMMD_LOCAL_RING": "1", "COMMD_SCHEDULE": "1", "COMMD_RING_BRIDGE": "daemon"}}


#: The daemon's phases of an op, in order (``commd/observe/trace.py``); ``schedule`` or ``negotiate``;
#: an all-reduce between nodes has ``local``, ``wire`` and ``out`` instead of ``lane``.
PHASES = ("submit", "schedule", "negotiate", "queue", "agree", "lane", "local", "wire", "out", "reply")


def one_run(sim: Any, work: Path, elements: int, iters: int, setting: str, timeout: float,
            syscalls: bool, trace: bool = False) -> dict[str, Any]:
    cfg = {"elements": elements, "iters": iters, "warmup": 50, "strace": syscalls}
    env = dict(SETTINGS[setting])
    trace_path = work / f"trace-{setting}-{elements}-{len(list(work.iterdir()))}.json"
    if trace:
        env["COMMD_TRACE"] = str(trace_path)
    pointer = run_job(WORKER, cfg, env, work, f"ab-{setting}", timeout, sim)
    ranks = [json.loads(Path(pointer["rank0"].replace("-r0.json", f"-r{r}.json")).read_text()) for r in range(4)]
    nodes = [ranks[0], ranks[2]]  # each node's first rank also reports its daemon
    return {"latency_us": max(n["median_us"] for n in nodes),
            "cpu_us": sum(n["daemon_cpu_us"] for n in nodes) + sum(r["rank_cpu_us"] for r in ranks),
            "rank_csw": statistics.mean(r["rank_csw"] for r in ranks),
            "daemon_csw": statistics.mean(n["daemon_csw"] for n in nodes),
            "paths": [n["paths"] for n in nodes], "control": [n["control"] for n in nodes],
            "syscalls": nodes[0].get("syscalls"), "load": os.getloadavg()[0],
            "phases": [phase_medians(trace_path, node, elements * 4, iters) for node in (0, 1)] if trace else None}


def read_trace(path: Path) -> list[dict[str, Any]]:
    """One node's trace events: the finished file, or what its daemon had written (``.partial``)."""
    if path.exists():
        return json.loads(path.read_text())
    partial = path.with_name(f".{path.name}.partial")
    text = partial.read_text().rstrip().rstrip(",") if partial.exists() else "["
    return json.loads(text + "]")


def phase_medians(path: Path, node: int, nbytes: int, iters: int) -> dict[str, float]:
    """Median microseconds per phase over the node's last ``iters`` all-reduces of ``nbytes``
    (the timed loop: the warm-up's ops come first), each over the ops that had that phase."""
    from commd.observe.trace import node_trace_path

    begins: dict[tuple[int, str], float] = {}
    ops: dict[int, dict[str, float]] = {}
    timed: list[int] = []
    for event in read_trace(Path(node_trace_path(str(path), node))):
        if event.get("cat") != "commd" or event.get("ph") not in ("b", "e"):
            continue
        key = (event["id"], event["name"])
        if event["ph"] == "b":
            begins[key] = event["ts"]
            args = event.get("args")
            if args is not None and args.get("kind") == "allreduce" and args.get("bytes") == nbytes:
                timed.append(event["id"])
        elif key in begins and event["name"] in PHASES:
            ops.setdefault(event["id"], {})[event["name"]] = event["ts"] - begins[key]
    chosen = [ops[i] for i in timed[-iters:] if i in ops]
    return {phase: statistics.median(op[phase] for op in chosen if phase in op) for phase in PHASES
            if any(phase in op for op in chosen)} | {"ops": len(chosen)}


def print_phases(results: dict[int, dict[str, list[dict[str, Any]]]]) -> None:
    """Where the daemons' time goes: each phase's median per node (each setting's last run)."""
    print("\nthe daemons' phases of an op (COMMD_TRACE; medians in us, node 0 / node 1; each setting's last run):")
    for size, by_setting in results.items():
        for name, runs in by_setting.items():
            phases = runs[-1].get("phases")
            if not phases:
                continue
            cells = [f"{p} {phases[0].get(p, 0):.0f} / {phases[1].get(p, 0):.0f}" for p in PHASES
                     if p in phases[0] or p in phases[1]]
            print(f"{size:>9} {name:<11} " + "; ".join(cells) + f" ({phases[0]['ops']} ops)")


def print_syscalls(runs: dict[str, list[dict[str, Any]]]) -> None:
    """Node 0's system calls per op, by name, in each setting's last run."""
    counted = {name: r[-1]["syscalls"] for name, r in runs.items() if r and r[-1].get("syscalls")}
    if not counted:
        return
    for who in ("daemon", "rank"):
        names = sorted({c for calls in counted.values() for c in calls.get(who, {})},
                       key=lambda c: -max(calls.get(who, {}).get(c, 0) for calls in counted.values()))
        print(f"{'':>9} node 0's {who}, system calls per op: " + "; ".join(
            f"{name}: " + ", ".join(f"{c} {calls[who].get(c, 0):.2f}" for c in names
                                    if calls[who].get(c, 0) >= 0.05 or c == "total")
            for name, calls in counted.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1K,64K,1M", help="message sizes (default 1K,64K,1M)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per size and setting (default 3)")
    parser.add_argument("--iters", type=int, default=400, help="timed all-reduces per run (default 400)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds one run may take")
    parser.add_argument("--settings", default="schedule,negotiated",
                        help=f"comma-separated, from {','.join(SETTINGS)} (default schedule,negotiated)")
    parser.add_argument("--syscalls", action="store_true",
                        help="also count node 0's daemon's and first rank's system calls per op (strace -c)")
    parser.add_argument("--trace", action="store_true",
                        help="also trace every op (COMMD_TRACE) and print each phase's median per node "
                             "(tracing costs each op some CPU)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    settings = [name for name in args.settings.split(",") if name]
    if not settings or any(name not in SETTINGS for name in settings):
        parser.error(f"--settings: choose from {','.join(SETTINGS)}")
    try:
        sizes = [parse_bytes(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--sizes: {args.sizes!r} is not a list of sizes")
    if not sizes or any(s < 4 or s % 4 for s in sizes) or args.repeats < 1 or args.iters < 10:
        parser.error("sizes must be multiples of 4 bytes; --repeats >= 1; --iters >= 10")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("schedule_ab: terminated"))
    os.environ.setdefault("COMMD_SECRET", new_secret())  # the hosts' daemons share it (never in the store)
    from commd.sim.hosts import SimulatedHosts

    results: dict[int, dict[str, list[dict[str, Any]]]] = {}
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="commd-ab-") as tmp, SimulatedHosts(2) as sim:
        work = Path(tmp)
        for size in sizes:
            results[size] = {name: [] for name in settings}
            for rep in range(args.repeats):
                for name in (settings if rep % 2 == 0 else settings[::-1]):
                    print(f"[{size} B, {rep + 1}/{args.repeats}] {name} ...", file=sys.stderr, flush=True)
                    results[size][name].append(one_run(sim, work, size // 4, args.iters, name, args.timeout,
                                                       args.syscalls, args.trace))
    print(f"\nall_reduce through the torch backend, 2 simulated hosts x 2 ranks, COMMD_LOCAL_RING=0 (but 'ring'), "
          f"{args.iters} ops per run, medians of {args.repeats} interleaved runs "
          f"(load {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after)\n")
    print(f"{'size':>9} {'setting':<11} {'latency us':>11} {'CPU us/op':>10} {'daemon csw/op':>14} "
          f"{'rank csw/op':>12}   runs' latencies")
    for size, by_setting in results.items():
        for name, runs in by_setting.items():
            print(f"{size:>9} {name:<11} {statistics.median(r['latency_us'] for r in runs):>11.0f} "
                  f"{statistics.median(r['cpu_us'] for r in runs):>10.0f} "
                  f"{statistics.median(r['daemon_csw'] for r in runs):>14.2f} "
                  f"{statistics.median(r['rank_csw'] for r in runs):>12.2f}   "
                  f"{[round(r['latency_us']) for r in runs]}")
        for name, runs in by_setting.items():
            print(f"{'':>9} ({name}: ops per path on node 0 {runs[-1]['paths'][0]}, control items "
                  f"{runs[-1]['control'][0]})")
        print_syscalls(by_setting)
    print_phases(results)
    if args.json:
        Path(args.json).write_text(json.dumps({str(k): v for k, v in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
