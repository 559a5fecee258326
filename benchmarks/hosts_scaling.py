"""The torch backend on 2, 4, 8 and 16 simulated hosts x 1 rank: what each node pays per op as the job grows.

For each host count, each size and each setting — the schedule path (the default),
``COMMD_SCHEDULE=0`` (every op negotiated: through the control tree of fan-out 8 from 10 hosts
on) and ``star`` (negotiated, every node reporting straight to node 0) — one job under `commd launch`
(COMMD_LOCAL_RING=0: every op through the daemons) times back-to-back ``dist.all_reduce``
calls on ordinary float32 tensors.  Per run: the slowest node's median latency; CPU per op
*per node* (its daemon and its rank); the daemons' context switches per op; the daemon's and
the rank's resident memory (now and at peak); ops per path.  MPI directly (mpi4py under one
mpiexec across the same hosts) gives the wall-clock reference.  Every process shares this
machine's cores, so wall time grows with the host count; CPU per op per node and the control
messages do not depend on it.  Needs root.

    sudo .venv/bin/python benchmarks/hosts_scaling.py                       # 2,4,8,16 hosts; 1 KiB and 1 MiB
    sudo .venv/bin/python benchmarks/hosts_scaling.py --hosts 2,4 --sizes 1K --no-mpi
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

from _launch import run_job

from commd.bench.orchestrate import MPI_HOSTS_ENV, mpiexec_path
from commd.runtime import new_secret, parse_bytes

WORKER = Path(__file__).with_name("_schedule_ab_worker.py")
MPI_WORKER = Path(__file__).with_name("_mpi_allreduce.py")
#: What each setting sets: the schedule path; every op negotiated (through the control tree from 10
#: hosts on); every op negotiated on a star (every node's reports straight to node 0).
SETTINGS = {"schedule": {"COMMD_SCHEDULE": "1"}, "negotiated": {"COMMD_SCHEDULE": "0"},
            "star": {"COMMD_SCHEDULE": "0", "COMMD_CONTROL_FANOUT": "4096"},
            # the torch backend's default for a small all-reduce: the bridged exchange ring, bridged
            # by each node's rank or by the daemons (the default; parts relayed by node 0)
            "ring": {"COMMD_LOCAL_RING": "1", "COMMD_RING_BRIDGE": "rank"},
            "ring-daemon": {"COMMD_LOCAL_RING": "1", "COMMD_RING_BRIDGE": "daemon"}}


def iters_for(size: int, base: int) -> int:
    """Fewer timed ops for larger messages (a 1 MiB op on 16 hosts of 2 cores takes tens of ms)."""
    return max(20, base if size <= 64 << 10 else base // 8)


def commd_run(hosts: Any, work: Path, size: int, iters: int, setting: str, timeout: float) -> dict[str, Any]:
    cfg = {"elements": size // 4, "iters": iters, "warmup": 30 if size <= 64 << 10 else 16}
    env = {"COMMD_LOCAL_RING": "0", **SETTINGS[setting]}
    pointer = run_job(WORKER, cfg, env, work, f"scale{len(hosts.hosts)}-{setting}", timeout, hosts, nproc=1)
    nodes = [json.loads(Path(pointer["rank0"].replace("-r0.json", f"-r{r}.json")).read_text())
             for r in range(len(hosts.hosts))]
    per_node = [n["daemon_cpu_us"] + n["rank_cpu_us"] for n in nodes]
    return {"latency_us": max(n["median_us"] for n in nodes),
            "cpu_per_node_us": statistics.mean(per_node), "cpu_busiest_node_us": max(per_node),
            "cpu_node0_us": per_node[0],
            "daemon_csw": statistics.mean(n["daemon_csw"] for n in nodes),
            "daemon_rss_mib": max((n["daemon_rss_mib"] or {}).get("peak", 0) for n in nodes),
            "rank_rss_mib": max((n["rank_rss_mib"] or {}).get("peak", 0) for n in nodes),
            "paths_node0": nodes[0]["paths"], "schedule_node0": nodes[0]["schedule"],
            "load": os.getloadavg()[0]}


def mpi_run(hosts: Any, work: Path, sizes: list[int], base_iters: int, timeout: float) -> dict[int, float]:
    """MPI's median all-reduce time per size (the slowest rank of each iteration), in microseconds."""
    n = len(hosts.hosts)
    out = work / f"mpi{n}-{{rank}}.json"
    cfg = work / f"mpi{n}-cfg.json"
    cfg.write_text(json.dumps({"nproc": n, "out": str(out),
                               "plan": [{"bytes": s, "warmup": 20, "iters": iters_for(s, base_iters)} for s in sizes]}))
    cmd = [mpiexec_path()]
    for i, host in enumerate(hosts.hosts):
        cmd += ([":"] if i else []) + ["-n", "1", *host.argv([sys.executable, str(MPI_WORKER), str(cfg)])]
    env = {**os.environ, **MPI_HOSTS_ENV, "MPIR_CVAR_NUM_CLIQUES": str(n)}
    with open(work / f"mpi{n}.log", "w") as log:
        code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
    if code != 0:
        raise SystemExit(f"mpiexec on {n} hosts exited with {code}; log in {work}/mpi{n}.log")
    ranks = [json.loads(Path(str(out).format(rank=r)).read_text())["results"] for r in range(n)]
    medians = {}
    for k, size in enumerate(sizes):
        slowest = [max(times) for times in zip(*(r[k]["times"] for r in ranks), strict=True)]
        medians[size] = statistics.median(slowest) * 1e6
    return medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", default="2,4,8,16", help="host counts (default 2,4,8,16)")
    parser.add_argument("--sizes", default="1K,1M", help="message sizes (default 1K,1M)")
    parser.add_argument("--iters", type=int, default=200, help="timed all-reduces per run up to 64 KiB (default "
                        "200; an eighth of it above)")
    parser.add_argument("--settings", default="schedule,negotiated",
                        help="of schedule, negotiated (through the control tree from 10 hosts on), star "
                             "(negotiated, every node reporting to node 0)")
    parser.add_argument("--no-mpi", action="store_true", help="skip MPI directly")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    try:
        counts = sorted({int(h) for h in args.hosts.split(",") if h.strip()})
        sizes = [parse_bytes(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--hosts {args.hosts!r} / --sizes {args.sizes!r}: not lists of integers and sizes")
    settings = [s for s in args.settings.split(",") if s]
    if (not counts or counts[0] < 2 or not sizes or any(s < 4 or s % 4 for s in sizes)
            or not settings or any(s not in SETTINGS for s in settings) or args.iters < 10):
        parser.error("host counts >= 2; sizes multiples of 4 bytes; settings from schedule,negotiated,star,ring,ring-daemon; --iters >= 10")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("hosts_scaling: terminated"))
    os.environ.setdefault("COMMD_SECRET", new_secret())  # the hosts' daemons share it (never in the store)
    from commd.sim.hosts import SimulatedHosts

    results: dict[str, Any] = {}
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="commd-scale-") as tmp, SimulatedHosts(counts[-1]) as sim:
        work = Path(tmp)
        for n in counts:
            hosts = types.SimpleNamespace(hosts=sim.hosts[:n])
            row: dict[str, Any] = {"commd": {}}
            for size in sizes:
                for setting in settings:
                    print(f"[{n} hosts, {size} B] {setting} ...", file=sys.stderr, flush=True)
                    row["commd"][f"{size}/{setting}"] = commd_run(hosts, work, size, iters_for(size, args.iters),
                                                                   setting, args.timeout)
            if not args.no_mpi:
                print(f"[{n} hosts] mpi ...", file=sys.stderr, flush=True)
                row["mpi"] = mpi_run(hosts, work, sizes, args.iters, args.timeout)
            results[str(n)] = row
    print(f"\nall_reduce through the torch backend, N simulated hosts x 1 rank, COMMD_LOCAL_RING=0, on "
          f"{os.cpu_count()} cores (load {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after)\n")
    print(f"{'hosts':>5} {'size':>8} {'setting':<11} {'latency us':>11} {'MPI us':>8} {'CPU us/op/node':>15} "
          f"{'x 2 hosts':>10} {'node 0':>8} {'csw/op':>7} {'daemon MiB':>11} {'rank MiB':>9}  node 0's ops per path")
    first = str(counts[0])
    for n, row in results.items():
        for key, r in row["commd"].items():
            size, setting = key.split("/")
            base = results[first]["commd"][key]["cpu_per_node_us"]
            mpi = row.get("mpi", {}).get(int(size))
            print(f"{n:>5} {size:>8} {setting:<11} {r['latency_us']:>11.0f} "
                  f"{(f'{mpi:.0f}' if mpi is not None else '-'):>8} {r['cpu_per_node_us']:>15.0f} "
                  f"{r['cpu_per_node_us'] / base:>10.2f} {r['cpu_node0_us']:>8.0f} {r['daemon_csw']:>7.1f} "
                  f"{r['daemon_rss_mib']:>11.0f} {r['rank_rss_mib']:>9.0f}  {r['paths_node0']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
