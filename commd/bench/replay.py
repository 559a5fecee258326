"""`commd replay TRACE_DIR`: a recorded job's communication, replayed through commd's lanes, Gloo and MPI.

A job recorded once (``commd launch --record DIR``: one PARAM comms trace per rank)
is replayed without its model, path after path in one run, on this host or on
simulated hosts (``commd bench``'s layout options and machinery, orchestrate.py):

- ``commd``: the commd backend, the daemons choosing each op's lane;
- ``commd-tcp``, ``commd-gloo``, ``commd-mpi``: every group pinned to one lane
  (``Options(lane=...)``); ``all-lanes`` is all three;
- ``gloo``: torch.distributed's Gloo backend; ``mpi``: mpi4py under mpiexec.

Each path is a fresh job (``commd launch`` of ``commd.bench.replay_worker``, or
``mpiexec`` of ``commd.bench.replay_mpi``) whose ranks write their figures to
files; this process reads them and prints, per path, the step time (median and
p95 over the timed passes' steps, each step the slowest rank's) and the
communication time per step, beside the recorded figures, with the ratios to the
best single lane, to Gloo and to MPI (above 1: the path is faster).  For the commd
paths it shows which lane each op kind took on node 0 (its daemon's counts).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from commd.bench import load
from commd.bench.orchestrate import (
    PY,
    BenchError,
    Layout,
    Procs,
    add_layout_arguments,
    check_layout,
    mpiexec_command,
    mpiexec_path,
    signals_unwind,
    simulated_hosts,
    start_launchers,
    tail,
    wait_procs,
)
from commd.bench.replay_worker import (
    COMPUTE_CHOICES,
    DEFAULT_OP_TIMEOUT_S,
    LANES,
    Plan,
    ReplayError,
    build_plan,
    check_passes,
)
from commd.bench.report import arguments_json, host, versions
from commd.protocol.param_trace import TraceError, load_dir, match_collectives

#: The path words of --paths: commd tuned, commd pinned to a lane, Gloo and MPI directly.
LANE_PATHS = {f"commd-{lane}": lane for lane in LANES}
PATH_WORDS = ("commd", *LANE_PATHS, "gloo", "mpi", "all-lanes")
DEFAULT_PATHS = "commd,gloo,mpi"
FORMAT = "commd-replay"


@dataclass(frozen=True)
class ReplayPath:
    """One way of replaying the trace."""

    label: str
    backend: str  # "commd", "gloo" or "mpi"
    lane: str | None = None  # commd pinned to this lane


def parse_paths(text: str) -> list[ReplayPath]:
    """--paths: the path words in order, ``all-lanes`` expanded, repeats dropped; ReplayError otherwise."""
    words = [w.strip() for w in text.split(",") if w.strip()]
    if not words:
        raise ReplayError(f"--paths {text!r}: name at least one of {','.join(PATH_WORDS)}")
    out: dict[str, ReplayPath] = {}
    for word in words:
        if word not in PATH_WORDS:
            raise ReplayError(f"--paths: unknown path {word!r}; choose from {','.join(PATH_WORDS)}")
        for label in LANE_PATHS if word == "all-lanes" else [word]:
            backend = "commd" if label.startswith("commd") else label
            out.setdefault(label, ReplayPath(label, backend, LANE_PATHS.get(label)))
    return list(out.values())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace_dir", metavar="TRACE_DIR",
                        help="a directory of per-rank PARAM comms traces (rank<R>.json), e.g. from "
                             "`commd launch --record DIR`")
    parser.add_argument("--paths", default=DEFAULT_PATHS,
                        help=f"what to replay through, in order (default {DEFAULT_PATHS}): commd (the daemons "
                             "choose each op's lane), commd-tcp, commd-gloo, commd-mpi (every group pinned to that "
                             "lane), all-lanes (all three), gloo (torch's Gloo backend), mpi (mpi4py under mpiexec)")
    add_layout_arguments(parser, nproc_default=None,
                         nproc_help="ranks per node (default: the trace's ranks, shared evenly over the hosts)")
    parser.add_argument("--iters", type=int, default=10, help="timed passes over the trace per path (default 10)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed passes before them (default 1); the first pass checks results")
    parser.add_argument("--compute", choices=COMPUTE_CHOICES, default="recorded",
                        help="recorded (default): each recorded gap between two calls is busy CPU work, as the "
                             "model's compute was; none: the calls back to back (communication only)")
    parser.add_argument("--op-timeout", type=float, default=DEFAULT_OP_TIMEOUT_S,
                        help=f"seconds one op may take (default {DEFAULT_OP_TIMEOUT_S:g})")
    parser.add_argument("--json", metavar="FILE", help="write every path's figures, the recorded ones and the run's "
                                                       "settings to FILE")


# ---- setup: everything checked before anything starts ----------------------------------------
@dataclass
class Setup:
    trace_dir: Path
    plans: dict[int, Plan]
    groups: int
    layout: Layout
    paths: list[ReplayPath]
    iters: int
    warmup: int
    compute: str
    op_timeout: float
    json_path: Path | None
    arguments: dict[str, Any] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return len(self.plans)


def prepare(args: argparse.Namespace) -> Setup:
    """The run's settings, every input checked; ReplayError / BenchError / TraceError say what is wrong."""
    paths = parse_paths(args.paths)
    check_passes(args)
    json_path = Path(args.json).expanduser().absolute() if args.json else None
    if json_path is not None and not json_path.parent.is_dir():
        raise ReplayError(f"--json {args.json}: no directory {json_path.parent}")
    trace_dir = Path(args.trace_dir).expanduser().absolute()
    traces = load_dir(trace_dir)
    world = len(traces)
    matched = match_collectives(traces)
    plans = {rank: build_plan(traces, rank, matched) for rank in traces}
    hosts = args.hosts or 0
    nproc = args.nproc
    if nproc is None:
        if hosts and world % hosts:
            raise ReplayError(f"the trace in {trace_dir} has {world} ranks, which {hosts} hosts cannot share evenly; "
                              "give --nproc-per-node")
        nproc = world // hosts if hosts else world
    layout = Layout(nproc=nproc, hosts=hosts, rate=args.rate, delay_ms=args.delay_ms, timeout=args.timeout)
    if layout.world != world:
        given = f"--hosts {hosts} x --nproc-per-node {nproc}" if hosts else f"--nproc-per-node {nproc}"
        raise ReplayError(f"the trace in {trace_dir} has {world} ranks (rank0..rank{world - 1}.json), but {given} "
                          f"makes {layout.world}")
    check_layout(layout)
    if any(p.backend == "mpi" for p in paths):
        if importlib.util.find_spec("mpi4py") is None:
            raise ReplayError("the mpi path needs mpi4py (pip install mpi4py mpich)")
        try:
            mpiexec_path()
        except BenchError:
            raise ReplayError("the mpi path needs mpiexec next to this python or on PATH (pip install mpich)") from None
    n_groups = len(plans[0].groups) + 1
    return Setup(trace_dir, plans, n_groups, layout, paths, args.iters, args.warmup, args.compute, args.op_timeout,
                 json_path, arguments_json(args))


# ---- running the paths ---------------------------------------------------------------------------
@dataclass
class PathRun:
    """What one path's ranks wrote, or why it has no figures."""

    path: ReplayPath
    status: str  # "ok", "failed", "skipped", "not run"
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)
    reason: str | None = None
    seconds: float = 0.0


def worker_options(setup: Setup, out: Path) -> list[str]:
    return ["--trace", str(setup.trace_dir), "--iters", str(setup.iters), "--warmup", str(setup.warmup),
            "--compute", setup.compute, "--op-timeout", repr(setup.op_timeout), "--out", str(out / "rank{rank}.json")]


def read_results(out: Path, world: int) -> dict[int, dict[str, Any]]:
    found = {}
    for rank in range(world):
        try:
            found[rank] = json.loads((out / f"rank{rank}.json").read_text())
        except (OSError, ValueError):
            continue
    return found


def run_path(setup: Setup, path: ReplayPath, sim: Any, work: Path, deadline: float) -> PathRun:
    """One path, start to end (its processes always stopped); its ranks' results."""
    out = work / path.label
    out.mkdir()
    options = worker_options(setup, out)
    procs = Procs()
    started = time.monotonic()
    run = PathRun(path, "ok")
    watch: list[Any] = []

    def failure() -> str | None:
        errors = [r["error"] for r in read_results(out, setup.world).values() if r.get("error")]
        return errors[0] if errors else None

    try:
        if path.backend == "mpi":
            cmd, env = mpiexec_command(setup.layout, sim, [PY, "-m", "commd.bench.replay_mpi", *options])
            log = out / "mpiexec.log"
            watch = [(procs.start(cmd, env, log, "mpiexec"), log, "mpiexec")]
        else:
            worker = ["-m", "commd.bench.replay_worker", *options, "--backend", path.backend]
            if path.lane is not None:
                worker += ["--lane", path.lane]
            watch = start_launchers(setup.layout, sim, worker, setup.op_timeout, out, procs)
        wait_procs(watch, deadline, f"commd replay ({path.label})", failure=failure)
    except BenchError as exc:
        run.status, run.reason = "failed", str(exc)
    finally:
        procs.stop()
    run.seconds = time.monotonic() - started
    run.ranks = read_results(out, setup.world)
    skipped = [r["skipped"] for r in run.ranks.values() if r.get("skipped")]
    if skipped:
        run.status, run.reason = "skipped", skipped[0]
    elif run.status == "ok" and len(run.ranks) != setup.world:
        missing = sorted(set(range(setup.world)) - set(run.ranks))
        logs = "\n".join(f"--- last lines of {log} ---\n{tail(log)}" for _, log, _ in watch)
        run.status, run.reason = "failed", f"ranks {missing} wrote no results\n{logs}"
    return run


def execute(setup: Setup) -> tuple[list[PathRun], dict[str, Any]]:
    """Every path in order, on this host or on simulated hosts made for the run; the runs and the load."""
    layout = setup.layout
    watch = load.LoadWatch(load.needs_of(layout.nproc, layout.hosts), os.cpu_count() or 1, load.read_loadavg)
    warning = watch.begin()
    if warning:
        print(f"commd replay: {warning}", file=sys.stderr, flush=True)
    started = time.monotonic()
    deadline = started + layout.timeout
    work = Path(tempfile.mkdtemp(prefix="commd-replay-"))
    runs: list[PathRun] = []
    keep = False
    try:
        with signals_unwind(), simulated_hosts(layout) as sim:
            where = (f"{layout.hosts} simulated hosts x {_count(layout.nproc, 'rank')}" if sim is not None
                     else f"this host, {_count(layout.nproc, 'rank')}")
            print(f"commd replay: {setup.trace_dir} on {where}", file=sys.stderr, flush=True)
            for path in setup.paths:
                if time.monotonic() > deadline:
                    runs.append(PathRun(path, "not run", reason="--timeout passed before its turn"))
                    continue
                print(f"commd replay: {path.label} ...", file=sys.stderr, flush=True)
                run = run_path(setup, path, sim, work, deadline)
                keep = keep or run.status == "failed"
                runs.append(run)
    except BaseException:
        keep = True
        raise
    finally:
        if keep:
            print(f"commd replay: the logs of this run are kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    warning = watch.finish(time.monotonic() - started)
    if warning:
        print(f"commd replay: {warning}", file=sys.stderr, flush=True)
    return runs, watch.to_json()


# ---- figures ---------------------------------------------------------------------------------------
def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, -(-95 * len(ordered) // 100) - 1)]


def stats_ms(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values) * 1e3, "p95": p95(values) * 1e3}


def recorded_figures(plans: dict[int, Plan]) -> dict[str, Any]:
    """The trace's own figures: per step the slowest rank's wall and communication time."""
    by_step: dict[int, list[dict[str, float]]] = {}
    for plan in plans.values():
        for row in plan.recorded:
            by_step.setdefault(int(row["step"]), []).append(row)
    walls = [max(r["wall_s"] for r in rows) for rows in by_step.values()]
    comms = [max(r["comm_s"] for r in rows) for rows in by_step.values()]
    iteration = max(sum(r["wall_s"] for r in plan.recorded) for plan in plans.values()) if plans else 0.0
    return {"step_ms": stats_ms(walls), "comm_ms": stats_ms(comms), "iteration_ms": {"median": iteration * 1e3},
            "steps": len(by_step)}


def path_figures(ranks: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """A path's figures from its ranks' results: per timed pass and step the slowest rank's times."""
    timed = min(len(r["iterations"]) for r in ranks.values())
    walls, comms, passes = [], [], []
    for i in range(timed):
        by_step: dict[int, list[dict[str, float]]] = {}
        for result in ranks.values():
            for row in result["iterations"][i]["steps"]:
                by_step.setdefault(int(row["step"]), []).append(row)
        walls += [max(r["wall_s"] for r in rows) for rows in by_step.values()]
        comms += [max(r["comm_s"] for r in rows) for rows in by_step.values()]
        passes.append(max(result["iterations"][i]["wall_s"] for result in ranks.values()))
    return {"step_ms": stats_ms(walls), "comm_ms": stats_ms(comms), "iteration_ms": stats_ms(passes),
            "samples": len(walls), "checked": sum(int(r.get("checked", 0)) for r in ranks.values())}


def summarize(setup: Setup, runs: list[PathRun], load_json: dict[str, Any]) -> dict[str, Any]:
    """The run as one JSON-able document (what --json writes and the table shows)."""
    rows: list[dict[str, Any]] = []
    for run in runs:
        row: dict[str, Any] = {"path": run.path.label, "backend": run.path.backend, "lane": run.path.lane,
                               "status": run.status, "seconds": round(run.seconds, 1)}
        if run.reason:
            row["reason"] = run.reason
        if run.status == "ok":
            row.update(path_figures(run.ranks))
            first = run.ranks.get(0, {})
            notes = list(dict.fromkeys(n for r in run.ranks.values() for n in r.get("notes", [])))
            if notes:
                row["notes"] = notes
            if "lanes" in first:
                row["lanes"] = first["lanes"]
                row["fabric_lanes"] = first.get("fabric_lanes")
        rows.append(row)
    medians = {r["path"]: r["step_ms"]["median"] for r in rows if r["status"] == "ok" and r.get("step_ms")}
    lanes = [r["path"] for r in rows if r["path"] in LANE_PATHS and r["path"] in medians]
    best = min(lanes, key=lambda label: medians[label]) if lanes else None
    recorded = recorded_figures(setup.plans)
    for row in [recorded, *rows]:
        step = (row.get("step_ms") or {}).get("median")
        if not step:
            continue
        row["ratios"] = {name: (medians[ref] / step if ref in medians else None)
                         for name, ref in (("best_lane", best), ("gloo", "gloo"), ("mpi", "mpi"))}
    layout = setup.layout
    return {
        "format": FORMAT, "version": 1, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "versions": versions(),
        "host": host(),
        "trace": {"dir": str(setup.trace_dir), "world": setup.world, "groups": setup.groups,
                  "ops": {str(rank): plan.ops for rank, plan in setup.plans.items()},
                  "steps": recorded["steps"]},
        "layout": {"hosts": layout.hosts, "nproc_per_node": layout.nproc, "world": layout.world,
                   "rate": layout.rate, "delay_ms": layout.delay_ms},
        "settings": {"iters": setup.iters, "warmup": setup.warmup, "compute": setup.compute,
                     "op_timeout": setup.op_timeout},
        "arguments": setup.arguments, "load": load_json, "recorded": recorded, "paths": rows, "best_lane": best,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}" if value < 10 else f"{value:.1f}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_report(doc: dict[str, Any]) -> str:
    """The table people read: one row per path, the recorded figures first."""
    trace, layout, settings = doc["trace"], doc["layout"], doc["settings"]
    where = (f"{layout['hosts']} simulated hosts x {_count(layout['nproc_per_node'], 'rank')}" if layout["hosts"]
             else f"this host, {_count(layout['world'], 'rank')}")
    ops = sorted(set(trace["ops"].values())) or [0]
    per_rank = f"{ops[0]}" if len(ops) == 1 else f"{ops[0]}..{ops[-1]}"
    lines = [f"commd replay: {trace['dir']}: {_count(trace['world'], 'rank')}, {per_rank} ops a pass per rank, "
             f"{_count(trace['steps'], 'step')}, {_count(trace['groups'], 'group')}; {where}; compute "
             f"{settings['compute']}; {settings['iters']} timed passes after {settings['warmup']} warm-up",
             "per step the slowest rank's time (median and p95 over the timed passes' steps); x PATH: PATH's step "
             "time over this row's (above 1: this row is faster)", ""]
    headers = ["path", "step ms", "p95 ms", "comm/step ms", "x best lane", "x gloo", "x mpi", "check"]
    table = []
    rec = doc["recorded"]
    table.append(["recorded", _ms((rec.get("step_ms") or {}).get("median")), _ms((rec.get("step_ms") or {}).get("p95")),
                  _ms((rec.get("comm_ms") or {}).get("median")),
                  *[_ratio((rec.get("ratios") or {}).get(k)) for k in ("best_lane", "gloo", "mpi")], "-"])
    for row in doc["paths"]:
        if row["status"] != "ok":
            table.append([row["path"], row["status"], "", "", "", "", "", ""])
            continue
        ratios = row.get("ratios") or {}
        table.append([row["path"], _ms(row["step_ms"]["median"]), _ms(row["step_ms"]["p95"]),
                      _ms(row["comm_ms"]["median"]), *[_ratio(ratios.get(k)) for k in ("best_lane", "gloo", "mpi")],
                      f"ok ({row['checked']})"])
    widths = [max(len(str(r[i])) for r in [headers, *table]) for i in range(len(headers))]
    for r in [headers, *table]:
        lines.append("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip())
    if doc.get("best_lane"):
        lines.append(f"best single lane: {doc['best_lane']}")
    lane_rows = [r for r in doc["paths"] if r.get("lanes") is not None]
    if lane_rows:
        lines += ["", "lanes each op kind took in the timed passes (node 0's daemon; 'local': the node's own ranks, "
                      "'ring': all-reduces the exchange rings ran without the daemon)"]
        for r in lane_rows:
            kinds = "; ".join(f"{kind}: " + ", ".join(f"{lane} {v['ops']}" for lane, v in sorted(row.items()))
                              for kind, row in sorted(r["lanes"].items())) or "(no ops counted)"
            lines.append(f"  {r['path']}: {kinds}")
    for r in doc["paths"]:
        for note in r.get("notes", []):
            lines.append(f"note ({r['path']}): {note}")
        if r["status"] != "ok" and r.get("reason"):
            lines.append(f"{r['path']} {r['status']}: {r['reason']}")
    loaded = doc.get("load") or {}

    def three(sample: dict[str, float] | None) -> str:
        return " ".join(f"{sample[k]:.2f}" for k in ("1m", "5m", "15m")) if sample else "unknown"

    if loaded:
        lines += ["", f"load average (1/5/15 min): {three(loaded.get('start'))} before, {three(loaded.get('end'))} "
                      f"after; {loaded['cores']} cores, the run needs {loaded['needed_cores']} ({loaded['needed']})"]
        lines += loaded.get("warnings") or []
    return "\n".join(lines)


# ---- the command -------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    try:
        setup = prepare(args)
    except (ReplayError, BenchError, TraceError) as exc:
        print(f"commd replay: {exc}", file=sys.stderr)
        return 2
    try:
        runs, load_json = execute(setup)
    except BenchError as exc:
        print(f"commd replay: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("commd replay: interrupted; stopped every process and removed the simulated hosts", file=sys.stderr)
        return 130
    doc = summarize(setup, runs, load_json)
    print(format_report(doc), flush=True)
    if setup.json_path is not None:
        setup.json_path.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {setup.json_path}", file=sys.stderr)
    return 0 if all(r.status in ("ok", "skipped") for r in runs) else 1
