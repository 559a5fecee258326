"""DDP across 2 simulated hosts x 2 ranks with the schedule path on and off.

The same MLP trained with DistributedDataParallel over the `commd` backend, run
interleaved ``--repeats`` times per setting:

  schedule    the default: once DDP's buckets repeat, each step's all-reduces run on the
              schedule path (fabric/scheduled.py), without the coordinator;
  negotiated  COMMD_SCHEDULE=0: every all-reduce across the hosts is negotiated through node 0.

Per setting: the median step time (after the warm-up steps), the parameters' digest (the two
settings must train the same bits), and per step the control items node 0's coordinator
exchanged with node 1 and the ops per path on both nodes, read from each daemon's counters
after every step (outside the timed step).  Needs root (network namespaces).

    sudo .venv/bin/python benchmarks/ddp_schedule.py
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

from commd.runtime import new_secret

WORKER = Path(__file__).with_name("_ddp_schedule_worker.py")
WARMUP_STEPS = 3


def per_step(counters: list[dict[str, Any]], key: str, field: str) -> list[int]:
    """Differences of one counter from step to step (the first step against zero)."""
    values = [c[key][field] for c in counters]
    return [b - a for a, b in zip([0, *values], values, strict=False)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="DDP bucket_cap_mb (default 1)")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("ddp_schedule: terminated"))
    cfg = {"seed": 3, "inputs": 256, "width": args.width, "layers": args.layers, "batch": 64,
           "steps": args.steps, "bucket_mb": args.bucket_mb}
    settings = {"schedule": {"COMMD_SCHEDULE": "1"}, "negotiated": {"COMMD_SCHEDULE": "0"}}
    load = os.getloadavg()
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in settings}
    with tempfile.TemporaryDirectory(prefix="commd-ddp-sched-") as tmp:
        work = Path(tmp)
        from commd.sim.hosts import SimulatedHosts

        with SimulatedHosts(2) as sim:
            names = list(settings)
            for rep in range(args.repeats):
                for name in names[rep % len(names):] + names[:rep % len(names)]:
                    print(f"[{rep + 1}/{args.repeats}] {name} ...", file=sys.stderr, flush=True)
                    # the same job secret on every node, as `commd launch --nnodes > 1` requires
                    env = {"COMMD_SECRET": new_secret(), **settings[name]}
                    pointer = run_job(WORKER, cfg, env, work, name, args.timeout, sim)
                    node0 = json.loads(Path(pointer["rank0"]).read_text())
                    node1 = json.loads(Path(pointer["rank0"].replace("-r0.json", "-r2.json")).read_text())
                    results[name].append({"node0": node0, "node1": node1})
    print(f"\nDDP, 2 simulated hosts x 2 ranks, MLP {args.layers}x{args.width}, bucket_cap_mb {args.bucket_mb}, "
          f"{args.steps} steps; median step after {WARMUP_STEPS}, median over {args.repeats} runs "
          f"(load {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after)\n")
    summary: dict[str, Any] = {}
    for name, runs in results.items():
        step = statistics.median(statistics.median(r["node0"]["times"][WARMUP_STEPS:]) for r in runs) * 1e3
        last = runs[-1]
        received = per_step(last["node0"]["counters"], "control", "received")
        sent = per_step(last["node0"]["counters"], "control", "sent")
        scheduled = [per_step(last[n]["counters"], "paths", "scheduled") for n in ("node0", "node1")]
        negotiated = [per_step(last[n]["counters"], "paths", "negotiated") for n in ("node0", "node1")]
        summary[name] = {"step_ms": step, "digest": last["node0"]["digest"], "loss": last["node0"]["loss"],
                         "coordinator_received_per_step": received, "coordinator_sent_per_step": sent,
                         "scheduled_per_step": scheduled, "negotiated_per_step": negotiated}
        print(f"  {name:<11} step {step:7.1f} ms   loss {last['node0']['loss']:.6f}   params {summary[name]['digest'][:12]}")
        print(f"    control items node 0 <- node 1 per step: {received}")
        print(f"    control items node 0 -> node 1 per step: {sent}")
        print(f"    ops on the schedule per step (node 0): {scheduled[0]}")
        print(f"    ops negotiated per step (node 0):      {negotiated[0]}")
    same = summary["schedule"]["digest"] == summary["negotiated"]["digest"]
    print(f"\n  schedule / negotiated step time: {summary['schedule']['step_ms'] / summary['negotiated']['step_ms']:.2f}"
          f"; parameters {'identical' if same else 'DIFFER'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "summary": summary}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
