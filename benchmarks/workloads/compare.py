"""The workloads end to end on simulated hosts: commd's mix against each single lane, Gloo and MPI.

For each layout (``4x1``: 4 simulated hosts x 1 rank, ``2x2``), link setting (``unshaped``,
``10gbit``: 10 Gbit/s + 0.1 ms, ``1gbit``: 1 Gbit/s + 0.25 ms) and workload (MoE with
capacity-padded and with dropless routing, DLRM, Megatron tensor x data parallel), one
training job per path, all in one run:

  commd        the torch backend "commd", the daemons' own choice per op (rules, tuning table,
               default): the mix (a short run before it records the job's PARAM trace, COMMD_RECORD);
  commd-LANE   the same with every group pinned to one lane (``Options(lane=LANE)``);
  gloo         torch.distributed Gloo directly;
  mpi          MPI directly: torch has no MPI backend in its CPU build, so the recorded trace
               is replayed through mpi4py.

Then ``commd replay`` replays the trace the mix recorded through every path (compute gaps as
recorded) on fresh hosts of the same layout and links: MPI's figure, and per path the replayed
step and communication time beside the real job's, which is how far a replay predicts a job.

Per cell: the median step time (the slowest rank's) over the timed steps, the ratios of
commd's mix to the best single lane and to Gloo, MPI's replayed step, and which lanes the mix
took per op kind and size class (node 0's ``commd status``).  Every process shares this
machine's cores: the load average is printed beside the table.  Needs root.

The mix is only as good as the tuning table node 0 loads: ``--tables DIR`` names one per setting
(``DIR/LINK-HxK.json``), ``--tune`` measures a missing one first with ``commd tune`` (the op kinds
the workloads issue, every group size from 2 nodes up); without ``--tables`` the daemons run on
their defaults.

    sudo .venv/bin/python benchmarks/workloads/compare.py --layouts 2x2 --links unshaped --workloads dlrm
    sudo .venv/bin/python benchmarks/workloads/compare.py --tables out/tables --tune --json out.json  # all (~1 h)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))


PY = sys.executable
WORKER = HERE / "worker.py"
WORKLOADS = {"moe-capacity": {"workload": "moe", "routing": "capacity"},
             "moe-dropless": {"workload": "moe", "routing": "dropless"},
             "dlrm": {"workload": "dlrm"}, "megatron": {"workload": "megatron"}}
LINKS = {"unshaped": (None, None), "10gbit": ("10gbit", 0.1), "1gbit": ("1gbit", 0.25)}
PIN_LANES = ("tcp", "gloo")
#: The op kinds the workloads issue between nodes, as `commd tune` names them.
TUNE_OPS = "allreduce,alltoall,alltoallv,allgather,broadcast"  # the lanes a `commd launch` fabric has (the mpi lane needs daemons under mpiexec)


#: Seconds one op of a workload may wait for its peers.
OP_TIMEOUT_S = 120.0


class RunFailed(RuntimeError):
    """One job did not finish; the message names it and where its logs are."""


def _layout(text: str) -> tuple[int, int]:
    hosts, _, nproc = text.partition("x")
    if not hosts.isdigit() or not nproc.isdigit() or int(hosts) < 2 or int(nproc) < 1:
        raise argparse.ArgumentTypeError(f"layout {text!r}: HOSTSxRANKS with at least 2 hosts, e.g. 4x1 or 2x2")
    return int(hosts), int(nproc)


def _wait(procs: list[subprocess.Popen[Any]], timeout: float, what: str, logs: str) -> None:
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise RunFailed(f"{what}: a process exited with {code}; logs: {logs}")
    except subprocess.TimeoutExpired:
        raise RunFailed(f"{what}: no result within {timeout:.0f} s; logs: {logs}") from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # (each started in its own session: its children too)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)


def _results(cfg: dict[str, Any], world: int) -> list[dict[str, Any]]:
    return [json.loads(Path(cfg["out"].format(rank=r)).read_text()) for r in range(world)]


def tune(hosts: int, nproc: int, link: str, table: Path, args: argparse.Namespace, work: Path) -> None:
    """`commd tune` of this layout and link setting, for the op kinds the workloads issue."""
    rate, delay = LINKS[link]
    cmd = [PY, "-m", "commd", "tune", "--hosts", str(hosts), "--nproc-per-node", str(nproc), "--ops", TUNE_OPS,
           "--max-bytes", args.tune_max_bytes, "--out", str(table)]
    if rate:
        cmd += ["--rate", rate, "--delay-ms", str(delay)]
    print(f"[{link}/{hosts}x{nproc}] commd tune ...", file=sys.stderr, flush=True)
    log = work / f"tune-{link}-{hosts}x{nproc}.log"
    with open(log, "w") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=3600).returncode
    if code != 0 or not table.exists():
        raise SystemExit(f"commd tune exited with {code}; log: {log}")


def run_commd(sim: Any, nproc: int, cfg: dict[str, Any], work: Path, tag: str, timeout: float,
              record: Path | None = None, table: Path | None = None) -> list[dict[str, Any]]:
    """One job under `commd launch` on every simulated host (the user's path), started as `commd bench`
    starts its own; ``table``: the tuning table node 0's daemon loads (else none: the daemons' defaults)."""
    from commd.bench.orchestrate import BenchError, Layout, Procs, start_launchers, wait_procs

    cfg_path = work / f"{tag}.json"
    cfg_path.write_text(json.dumps(cfg))
    logs = work / tag
    logs.mkdir()
    layout = Layout(nproc=nproc, hosts=len(sim.hosts), env={"COMMD_TUNING": str(table) if table else "off"})
    worker = (["--record", str(record)] if record is not None else []) + [str(WORKER), str(cfg_path)]
    procs = Procs()
    try:
        watch = start_launchers(layout, sim, worker, OP_TIMEOUT_S, logs, procs, tag)
        wait_procs(watch, time.monotonic() + timeout, tag)
    except BenchError as exc:
        raise RunFailed(f"{exc} (logs in {logs})") from None
    finally:
        procs.stop()
    return _results(cfg, layout.world)


def run_gloo(sim: Any, nproc: int, cfg: dict[str, Any], work: Path, tag: str, timeout: float) -> list[dict[str, Any]]:
    """The same ranks on torch.distributed Gloo directly, torchrun's environment set by hand."""
    cfg_path = work / f"{tag}.json"
    cfg_path.write_text(json.dumps(cfg))
    world = len(sim.hosts) * nproc
    base = {**os.environ, "MASTER_ADDR": sim.hosts[0].ip, "MASTER_PORT": str(random.randint(20000, 40000)),
            "WORLD_SIZE": str(world), "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
    procs = []
    for i, host in enumerate(sim.hosts):
        for local in range(nproc):
            rank = i * nproc + local
            env = {**base, **host.env, "RANK": str(rank), "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(nproc)}
            with open(work / f"{tag}-r{rank}.log", "w") as log:
                procs.append(host.popen([PY, str(WORKER), str(cfg_path)], env=env, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True))
    _wait(procs, timeout, tag, f"{work}/{tag}-r*.log")
    return _results(cfg, world)


def run_replay(hosts: int, nproc: int, link: str, trace: Path, args: argparse.Namespace, work: Path,
               tag: str) -> dict[str, Any]:
    """`commd replay` of the recorded trace on fresh simulated hosts of the same layout and links:
    every path (MPI directly among them), compute gaps as recorded."""
    rate, delay = LINKS[link]
    out = work / f"{tag}-replay.json"
    cmd = [PY, "-m", "commd", "replay", str(trace), "--hosts", str(hosts), "--nproc-per-node", str(nproc),
           "--paths", ",".join(["commd", *[f"commd-{lane}" for lane in args.lanes], "gloo", "mpi"]),
           "--iters", str(args.replay_iters), "--json", str(out), "--timeout", str(args.timeout)]
    if rate:
        cmd += ["--rate", rate, "--delay-ms", str(delay)]
    with open(work / f"{tag}-replay.log", "w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout + 60).returncode
    if not out.exists():
        raise RunFailed(f"commd replay exited with {code} and wrote nothing; log: {work}/{tag}-replay.log")
    return json.loads(out.read_text())


def step_median(results: list[dict[str, Any]]) -> float:
    """The median over timed steps of the slowest rank's step time (seconds)."""
    per_step = zip(*(r["step_times"] for r in results), strict=False)
    return statistics.median(max(times) for times in per_step)


def cell(sim: Any, nproc: int, name: str, args: argparse.Namespace, work: Path,
         table: Path | None) -> dict[str, Any]:
    """Every path of one workload in one layout and link setting."""
    base = {**WORKLOADS[name], "steps": args.steps, "warmup": args.warmup, "seed": 1, "preset": args.preset}
    row: dict[str, Any] = {"paths": {}, "errors": {}}
    tag = f"{name}-{len(sim.hosts)}x{nproc}"
    trace = work / f"{tag}-trace"

    def attempt(path: str, run: Any) -> None:
        print(f"  {path} ...", file=sys.stderr, flush=True)
        try:
            run()
        except RunFailed as exc:
            row["errors"][path] = str(exc)
            print(f"  {path}: {exc}", file=sys.stderr, flush=True)

    def record() -> None:
        cfg = {**base, "backend": "commd", "lane": None, "steps": 3, "warmup": 1,
               "out": str(work / f"{tag}-record-{{rank}}.out.json")}
        run_commd(sim, nproc, cfg, work, f"{tag}-record", args.timeout, trace, table)

    def commd_path(lane: str | None) -> None:
        path = f"commd-{lane}" if lane else "commd"
        cfg = {**base, "backend": "commd", "lane": lane, "out": str(work / f"{tag}-{path}-{{rank}}.out.json")}
        results = run_commd(sim, nproc, cfg, work, f"{tag}-{path}", args.timeout, None, table)
        row["paths"][path] = step_median(results)
        if lane is None:
            row["losses"] = results[0].get("losses")
            row["mix"] = results[0].get("mix")
            row["digest"] = results[0].get("params_digest") or results[0].get("digest")

    def gloo_path() -> None:
        cfg = {**base, "backend": "gloo", "lane": None, "out": str(work / f"{tag}-gloo-{{rank}}.out.json")}
        results = run_gloo(sim, nproc, cfg, work, f"{tag}-gloo", args.timeout)
        row["paths"]["gloo"] = step_median(results)
        row["gloo_losses"] = results[0].get("losses")

    if not args.no_replay:
        attempt("record", record)  # (its own short job: the timed ones do not pay for recording)
    attempt("commd", lambda: commd_path(None))
    for lane in args.lanes:
        attempt(f"commd-{lane}", lambda lane=lane: commd_path(lane))
    attempt("gloo", gloo_path)
    return row


def add_replay(row: dict[str, Any], replay: dict[str, Any]) -> None:
    """The replay's figures beside the real ones: MPI's step (MPI runs only the replay), and per path
    the replayed step and communication time against the real job's."""
    recorded = replay.get("recorded") or {}
    row["recorded_comm_ms"] = (recorded.get("comm_ms") or {}).get("median")
    row["replay"] = {}
    for path in replay.get("paths") or []:
        if path.get("status") != "ok":
            row["errors"][f"replay {path.get('path')}"] = path.get("reason") or path.get("status")
            continue
        step = path["step_ms"]["median"] / 1e3
        row["replay"][path["path"]] = {"step_s": step, "comm_ms": (path.get("comm_ms") or {}).get("median"),
                                       "lanes": path.get("lanes")}
        if path["path"] == "mpi":
            row["paths"]["mpi (replay)"] = step


def ratios(row: dict[str, Any]) -> None:
    """The mix against the best single lane, Gloo and MPI (above 1: the mix is faster)."""
    lanes = {p: t for p, t in row["paths"].items() if p.startswith("commd-")}
    mix = row["paths"].get("commd")
    if mix and lanes:
        best = min(lanes, key=lanes.get)
        row["best_lane"] = best
        row["x_best_lane"] = lanes[best] / mix
    if mix and row["paths"].get("gloo"):
        row["x_gloo"] = row["paths"]["gloo"] / mix
    if mix and row["paths"].get("mpi (replay)"):
        row["x_mpi"] = row["paths"]["mpi (replay)"] / mix
    row["same_losses_as_gloo"] = bool(row.get("losses")) and row.get("losses") == row.get("gloo_losses")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default="4x1,2x2", help="HOSTSxRANKS, comma separated (default 4x1,2x2)")
    parser.add_argument("--links", default="unshaped,10gbit,1gbit", help=f"of {','.join(LINKS)}")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"of {','.join(WORKLOADS)}")
    parser.add_argument("--lanes", default=",".join(PIN_LANES), help="commd lanes to pin one at a time")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per job (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument("--preset", default="bench", help="workload size preset (default bench)")
    parser.add_argument("--replay-iters", type=int, default=3, help="passes over each recorded trace per replayed "
                        "path (default 3)")
    parser.add_argument("--tables", default=None, metavar="DIR", help="tuning tables per setting, "
                        "DIR/LINK-HxK.json, loaded by the mix's node 0 (default: none, the daemons' defaults)")
    parser.add_argument("--tune", action="store_true", help="measure a missing table with `commd tune` first")
    parser.add_argument("--tune-max-bytes", default="4M", help="the largest size the tune measures (default 4M)")
    parser.add_argument("--no-replay", action="store_true", help="skip the replays (and with them MPI)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one job may take")
    parser.add_argument("--json", default=None, help="write every figure here")
    args = parser.parse_args()
    try:
        layouts = [_layout(t) for t in args.layouts.split(",") if t]
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    links = [x for x in args.links.split(",") if x]
    workloads = [x for x in args.workloads.split(",") if x]
    args.lanes = [x for x in args.lanes.split(",") if x]
    bad = [x for x in links if x not in LINKS] + [x for x in workloads if x not in WORKLOADS] + \
        [x for x in args.lanes if x not in PIN_LANES]
    if bad or not layouts or not links or not workloads or args.steps < 3 or args.warmup < 0:
        parser.error(f"unknown or empty choices {bad}; --steps >= 3")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("workloads: terminated"))
    from commd.sim.hosts import SimulatedHosts

    load_before = os.getloadavg()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="commd-workloads-") as tmp:
        work = Path(tmp)
        for link in links:
            rate, delay = LINKS[link]
            for hosts, nproc in layouts:
                table = Path(args.tables) / f"{link}-{hosts}x{nproc}.json" if args.tables else None
                if table is not None and not table.exists():
                    if not args.tune:
                        parser.error(f"no tuning table {table} (add --tune to measure one)")
                    table.parent.mkdir(parents=True, exist_ok=True)
                    tune(hosts, nproc, link, table, args, work)
                with SimulatedHosts(hosts, delay_ms=delay, rate=rate) as sim:
                    for name in workloads:
                        key = f"{link}/{hosts}x{nproc}/{name}"
                        print(f"[{key}]", file=sys.stderr, flush=True)
                        results[key] = cell(sim, nproc, name, args, work, table)
                        results[key]["table"] = str(table) if table else None
                for name in workloads:  # (after the hosts above are down: the replay makes its own)
                    key = f"{link}/{hosts}x{nproc}/{name}"
                    trace = work / f"{name}-{hosts}x{nproc}-trace"
                    if not args.no_replay and trace.is_dir():
                        print(f"[{key}] replay ...", file=sys.stderr, flush=True)
                        try:
                            add_replay(results[key], run_replay(hosts, nproc, link, trace, args, work,
                                                                f"{name}-{hosts}x{nproc}-{link}"))
                        except (RunFailed, subprocess.TimeoutExpired) as exc:
                            results[key]["errors"]["replay"] = str(exc)
                    ratios(results[key])
    load_after = os.getloadavg()
    print(f"\nstep time (ms, median of the slowest rank) on {os.cpu_count()} cores, load {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after\n")
    paths = ["commd", *[f"commd-{lane}" for lane in args.lanes], "gloo", "mpi (replay)"]
    print(f"{'setting':<32} " + " ".join(f"{p:>13}" for p in paths) + f" {'x best lane':>12} {'x gloo':>7} "
          f"{'x mpi':>6}  same losses as gloo")
    for key, row in results.items():
        cells = [row["paths"].get(p) for p in paths]
        print(f"{key:<32} " + " ".join(f"{c * 1e3:>13.1f}" if c else f"{'-':>13}" for c in cells)
              + f" {row.get('x_best_lane', 0):>12.2f} {row.get('x_gloo', 0):>7.2f} {row.get('x_mpi', 0):>6.2f}  "
              f"{row['same_losses_as_gloo']}")
    print("\nwhat the mix took (node 0's daemon, inter-node ops):")
    for key, row in results.items():
        for m in row.get("mix") or []:
            print(f"  {key:<32} {m['kind']:<10} {m['size']:<9} {m['lane']:<5} {m['algorithm']:<10} {m['codec']:<8} "
                  f"{m['ops']:>7,} ops")
    print("\nreplayed (commd replay of the trace the mix recorded, compute gaps as recorded): step ms, and "
          "communication ms per step against the recorded job's")
    for key, row in results.items():
        recorded = row.get("recorded_comm_ms")
        for path, rep in (row.get("replay") or {}).items():
            real = row["paths"].get(path)
            comm = rep.get("comm_ms")
            print(f"  {key:<32} {path:<11} step {rep['step_s'] * 1e3:>8.1f} (real {real * 1e3 if real else 0:>8.1f})"
                  f"  comm {comm or 0:>8.1f} (recorded {recorded or 0:>8.1f}"
                  f"{f', x{comm / recorded:.2f}' if comm and recorded else ''})")
    for key, row in results.items():
        for path, error in row["errors"].items():
            print(f"  {key}: {path} failed: {error}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "load": [load_before, load_after],
                                               "arguments": vars(args)}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
