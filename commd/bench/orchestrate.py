"""`commd bench` from a shell: start the ranks (here, or on simulated hosts), follow them, collect the rows.

Phase 1 runs the worker on every rank under `commd launch` — on this host, or
with ``--hosts H`` one launcher per simulated host (network namespaces,
optionally shaped links; the hosts are always removed afterwards, also on
Ctrl-C, SIGTERM or an error).  It measures commd per lane and, with
``--compare gloo``, Gloo directly.  Phase 2 (``--compare mpi``) runs the same
cells through mpi4py under ``mpiexec``, ranks placed on the same hosts.
Rank 0 of each phase appends rows to a JSON-lines file, which this process
reads while it waits (the progress bar).  Every wait has a deadline: a
phase that outlives ``--timeout`` is stopped and reported with its log tail.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from commd.bench import load
from commd.bench.report import Progress
from commd.bench.spec import BenchSpec, measure_argv
from commd.runtime import new_secret

PY = sys.executable
POLL_S = 0.1
#: Seconds a launcher gets to stop its workers and daemon after SIGTERM, and what we give it on top.
LAUNCH_GRACE_S = 5
STOP_GRACE_S = 30.0
#: Prefix of the simulated hosts' names and links (cleanup_stale finds a killed run's leftovers by it).
SIM_PREFIX = "cbench"

#: MPI directly across simulated hosts: all namespaces share one kernel and /dev/shm, so MPICH would
#: treat every rank as local.  These make it see one "node" per host (consecutive ranks, as placed)
#: and cross hosts over TCP on the namespace's eth0, as on real nodes; the multi-leader all-reduce
#: composition was measured the faster MPI here (benchmarks/multinode.py).
MPI_HOSTS_ENV = {
    "MPIR_CVAR_CLIQUES_BY_BLOCK": "1",
    "MPIR_CVAR_CH4_NETMOD": "ucx",
    "UCX_TLS": "tcp,self",
    "UCX_NET_DEVICES": "eth0",
    "MPIR_CVAR_ALLREDUCE_COMPOSITION": "4",
    "MPIR_CVAR_ALLREDUCE_SHM_PER_LEADER": str(4 << 20),
}


class BenchError(Exception):
    """The run failed or cannot start; the message says why (and where the logs are)."""


@dataclass
class Layout:
    """Where the ranks run."""

    nproc: int
    hosts: int = 0  # 0: this host, no simulation
    rate: str | None = None
    delay_ms: float | None = None
    timeout: float = 900.0
    env: dict[str, str] = field(default_factory=dict)  # extra environment for daemons and workers

    @property
    def world(self) -> int:
        return self.nproc * max(1, self.hosts)


def add_layout_arguments(parser: argparse.ArgumentParser, nproc_default: int | None = 2,
                         nproc_help: str = "ranks per node (default 2)") -> None:
    """The options that say where the ranks run (shared by `commd bench`, `commd tune` and `commd replay`)."""
    parser.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc", type=int, default=nproc_default,
                        metavar="N", help=nproc_help)
    parser.add_argument("--hosts", type=int, default=0, metavar="H",
                        help="run on H simulated hosts (network namespaces on one bridge; needs root); "
                             "default: this host only")
    parser.add_argument("--rate", default=None, help="with --hosts: link rate per host and direction, e.g. 10gbit")
    parser.add_argument("--delay-ms", type=float, default=None, help="with --hosts: one-way link delay in ms")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds the whole run may take before it is stopped (default 900)")


def layout_from_args(args: argparse.Namespace) -> Layout:
    """The Layout that ``add_layout_arguments``' options describe (checked later by ``check_layout``)."""
    return Layout(nproc=args.nproc, hosts=args.hosts, rate=args.rate, delay_ms=args.delay_ms,
                  timeout=args.timeout)


def check_layout(layout: Layout) -> None:
    """Clear errors before anything starts."""
    if not 1 <= layout.nproc <= 256:
        raise BenchError(f"--nproc-per-node {layout.nproc} must lie in [1, 256]")
    if layout.hosts == 1 or layout.hosts < 0 or layout.hosts > 64:
        raise BenchError(f"--hosts {layout.hosts}: give 2..64 simulated hosts (leave it out for this host only)")
    if layout.world < 2:
        raise BenchError("a communication benchmark needs at least 2 ranks: --nproc-per-node 2, or --hosts 2")
    if not layout.hosts and (layout.rate is not None or layout.delay_ms is not None):
        raise BenchError("--rate and --delay-ms shape the links of simulated hosts: they need --hosts")
    if layout.delay_ms is not None and not 0 <= layout.delay_ms <= 10_000:
        raise BenchError(f"--delay-ms {layout.delay_ms} must lie in [0, 10000]")
    if not layout.timeout > 0:
        raise BenchError("--timeout must be > 0 seconds")
    if layout.hosts:
        if os.geteuid() != 0:
            raise BenchError("--hosts simulates hosts with network namespaces, which needs root; run as root, "
                             "or leave --hosts out to benchmark this host's ranks")
        from commd.sim.hosts import netns_unavailable, parse_rate, shaping_unavailable

        if layout.rate is not None:
            try:
                parse_rate(layout.rate)
            except Exception as exc:
                raise BenchError(f"--rate {layout.rate!r}: {exc}") from None
        reason = netns_unavailable() or shaping_unavailable(layout.delay_ms, layout.rate)
        if reason:
            raise BenchError(f"cannot simulate hosts here: {reason}")


# ---- processes -------------------------------------------------------------------
class Procs:
    """Processes this run started, each in its own session; stop() always reaps them."""

    def __init__(self) -> None:
        self.live: list[tuple[subprocess.Popen[bytes], Path, str]] = []

    def start(self, argv: list[str], env: dict[str, str], log: Path, what: str) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.live.append((proc, log, what))
        return proc

    def stop(self) -> None:
        """SIGTERM (a launcher then stops its workers and daemon), SIGKILL the group after a grace period."""
        for proc, _, _ in self.live:
            if proc.poll() is None:
                _signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc, _, _ in self.live:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc, _, what in self.live:
            if proc.poll() is None:
                print(f"commd bench: {what} (pid {proc.pid}) ignored SIGTERM; killing it", file=sys.stderr)
            _signal(proc, signal.SIGKILL)  # also anything its session left behind
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
                print(f"commd bench: pid {proc.pid} survived SIGKILL", file=sys.stderr)
        self.live.clear()


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def tail(log: Path, lines: int = 25) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    keep = [line for line in text if "FutureWarning" not in line and "return func(*args" not in line]
    return "\n".join(keep[-lines:])


def base_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Our environment without an inherited commd job or secret (each phase gets a fresh job)."""
    env = dict(os.environ)
    for key in ("COMMD_JOB", "COMMD_SECRET"):
        env.pop(key, None)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


class RowsFile:
    """Follows a phase's JSON-lines file: meta, rows and error records, as rank 0 appends them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.meta: dict[str, Any] | None = None
        self.rows: list[dict[str, Any]] = []
        self.errors: list[str] = []

    def poll(self) -> int:
        """Reads complete new lines; returns how many rows arrived."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return 0
        end = data.rfind(b"\n") + 1
        self.offset += end
        new = 0
        for line in data[:end].splitlines():
            record = json.loads(line)
            if "meta" in record:
                self.meta = record["meta"]
            elif "error" in record:
                self.errors.append(record["error"])
            else:
                self.rows.append(record)
                new += 1
        return new


Watched = tuple[subprocess.Popen[bytes], Path, str]


def wait_procs(procs: list[Watched], deadline: float, what: str, tick: Callable[[], None] | None = None,
               failure: Callable[[], str | None] | None = None) -> None:
    """Until every process exited 0, calling ``tick`` each poll; the first failure raises BenchError with
    ``failure()``'s account if it gives one (the workers' own reason), else the process's log tail;
    so does the deadline."""
    pending = list(procs)
    while True:
        if tick is not None:
            tick()
        for item in list(pending):
            proc, log, name = item
            code = proc.poll()
            if code is None:
                continue
            pending.remove(item)
            if code != 0:
                reason = failure() if failure is not None else None
                if reason:
                    raise BenchError(reason)
                raise BenchError(f"{what}: {name} exited with code {code}\n--- last lines of {log} ---\n{tail(log)}")
        if not pending:
            return
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- last lines of {log} ---\n{tail(log)}" for _, log, _ in procs)
            raise BenchError(f"{what}: not finished within --timeout; stopped it (still running: "
                             f"{', '.join(n for p, _, n in pending if p.poll() is None)})\n{logs}")
        time.sleep(POLL_S)


def wait_phase(procs: list[Watched], rows: RowsFile, deadline: float, bar: Progress, what: str,
               extra_total: int = 0) -> None:
    """Until every process exited 0: progress from the rows file; the first failure or the deadline raises."""
    sized = False

    def tick() -> None:
        nonlocal sized
        new = rows.poll()
        if rows.meta is not None and not sized:
            bar.set_total(rows.meta["total"] + extra_total)
            sized = True
        if new:
            last = rows.rows[-1]
            bar.update(new, f"{last['op']} {last['bytes']} B {last['path']}")

    def failure() -> str | None:
        rows.poll()  # rank 0's own account (a wrong result, a bad lane, a vanished peer)
        return "\n".join(rows.errors) or None

    wait_procs(procs, deadline, what, tick, failure)
    rows.poll()


# ---- simulated hosts ---------------------------------------------------------------
@contextmanager
def simulated_hosts(layout: Layout) -> Iterator[Any]:
    """Up for the body, always down afterwards (namespaces, links, their processes, runtime dirs)."""
    if not layout.hosts:
        yield None
        return
    from commd.sim.hosts import SimulatedHosts, cleanup_stale

    cleanup_stale(SIM_PREFIX)  # what a killed earlier run of ours left behind
    sim = SimulatedHosts(layout.hosts, delay_ms=layout.delay_ms or None, rate=layout.rate, prefix=SIM_PREFIX)
    try:
        sim.up()
    except Exception as exc:
        raise BenchError(f"cannot create {layout.hosts} simulated hosts: {exc}") from None
    try:
        yield sim
    finally:
        try:
            sim.down()
        except Exception as exc:  # report, the body's outcome stays the one that counts
            print(f"commd bench: removing the simulated hosts failed: {exc}", file=sys.stderr)


@contextmanager
def signals_unwind() -> Iterator[None]:
    """SIGTERM/SIGHUP unwind like Ctrl-C, through every finally: processes stopped, hosts removed."""

    def handler(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# ---- phases ----------------------------------------------------------------------
def launch_argv(layout: Layout, worker: list[str], op_timeout: float, node_rank: int = 0,
                master: str | None = None, node_name: str | None = None) -> list[str]:
    """`commd launch` of ``worker`` (``-m module args...``) for one node of ``layout``."""
    argv = [PY, "-m", "commd", "launch", "--nproc-per-node", str(layout.nproc),
            "--op-timeout", repr(op_timeout), "--grace", str(LAUNCH_GRACE_S)]
    if layout.hosts:
        argv += ["--nnodes", str(layout.hosts), "--node-rank", str(node_rank), "--master", str(master),
                 "--node-name", str(node_name)]
    return argv + worker


def start_launchers(layout: Layout, sim: Any, worker: list[str], op_timeout: float, work: Path, procs: Procs,
                    what: str = "commd launch") -> list[Watched]:
    """One `commd launch` of ``worker`` per node (this host, or each simulated host with the job's secret,
    node 0 hosting the store); their logs go to ``work``."""
    if sim is None:
        log = work / "launch.log"
        started = procs.start(launch_argv(layout, worker, op_timeout), base_env(layout.env), log, what)
        return [(started, log, what)]
    master = f"{sim.hosts[0].ip}:{random.randint(20000, 60000)}"  # fresh namespace: any port is free
    secret = new_secret()  # every node's launcher gets the job secret; it never goes into the store
    watch = []
    for i, host in enumerate(sim.hosts):
        log = work / f"launch-{host.name}.log"
        env = base_env({**layout.env, **host.env, "GLOO_SOCKET_IFNAME": "eth0", "COMMD_SECRET": secret})
        argv = host.argv(launch_argv(layout, worker, op_timeout, i, master, host.name))
        name = f"{what} on {host.name}"
        watch.append((procs.start(argv, env, log, name), log, name))
    return watch


def _mpi_cells(spec: BenchSpec) -> int:
    return sum(1 if op == "barrier" else len(spec.sizes) for op in spec.ops)


def run_commd_phase(layout: Layout, spec: BenchSpec, sim: Any, work: Path, bar: Progress,
                    deadline: float) -> RowsFile:
    rows = RowsFile(work / "rows-commd.jsonl")
    procs = Procs()
    extra = _mpi_cells(spec) if "mpi" in spec.compare else 0
    worker_spec = replace(spec, compare=[c for c in spec.compare if c != "mpi"])
    worker = ["-m", "commd.bench.worker", *measure_argv(worker_spec), "--rows-out", str(rows.path)]
    try:
        watch = start_launchers(layout, sim, worker, spec.op_timeout, work, procs)
        wait_phase(watch, rows, deadline, bar, "commd bench", extra)
    finally:
        procs.stop()
    if rows.meta is None:
        raise BenchError(f"commd bench: the workers wrote no results (logs in {work})")
    return rows


def mpiexec_path() -> str:
    found = Path(PY).with_name("mpiexec")
    if found.exists():
        return str(found)
    which = shutil.which("mpiexec")
    if not which:
        raise BenchError("--compare mpi: mpiexec not found next to this python or on PATH (pip install mpich)")
    return which


def mpiexec_command(layout: Layout, sim: Any, worker: list[str]) -> tuple[list[str], dict[str, str]]:
    """``mpiexec`` running ``worker`` (a full argv) on every rank of ``layout``, and its environment: on
    simulated hosts, ``nproc`` consecutive ranks per host, each host one MPI node (``MPI_HOSTS_ENV``)."""
    cmd = [mpiexec_path()]
    env = base_env(layout.env)
    if sim is None:
        cmd += ["-n", str(layout.nproc), *worker]
    else:
        env.update(MPI_HOSTS_ENV, MPIR_CVAR_NUM_CLIQUES=str(layout.hosts))
        for i, host in enumerate(sim.hosts):
            if i:
                cmd.append(":")
            cmd += ["-n", str(layout.nproc), "-env", "COMMD_NODE", host.name, *host.argv(worker)]
    return cmd, env


def run_mpi_phase(layout: Layout, spec: BenchSpec, sim: Any, work: Path, bar: Progress,
                  deadline: float) -> RowsFile:
    rows = RowsFile(work / "rows-mpi.jsonl")
    worker = [PY, "-m", "commd.bench.mpi_worker", *measure_argv(replace(spec, compare=[])),
              "--rows-out", str(rows.path)]
    cmd, env = mpiexec_command(layout, sim, worker)
    log = work / "mpiexec.log"
    procs = Procs()
    try:
        started = procs.start(cmd, env, log, "mpiexec")
        wait_phase([(started, log, "mpiexec")], rows, deadline, bar, "commd bench --compare mpi")
    finally:
        procs.stop()
    return rows


def run(layout: Layout, spec: BenchSpec, desc: str = "commd bench",
        load_source: load.LoadSource | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Both phases; returns (layout meta, rows), the meta with the machine's load around the run
    (``meta["load"]``, see commd/bench/load.py; ``load_source`` replaces os.getloadavg).  Raises
    BenchError with the reason and the logs' tail."""
    check_layout(layout)
    if "mpi" in spec.compare:
        mpiexec_path()
    watch = load.LoadWatch(load.needs_of(layout.nproc, layout.hosts), os.cpu_count() or 1,
                           load_source or load.read_loadavg)
    warning = watch.begin()
    if warning:
        print(f"{desc}: {warning}", file=sys.stderr, flush=True)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="commd-bench-"))
    deadline = started + layout.timeout
    bar = Progress(0, enabled=True, desc=desc)
    ok = False
    try:
        with signals_unwind(), simulated_hosts(layout) as sim:
            where = (f"{layout.hosts} simulated hosts ({', '.join(h.ip for h in sim.hosts)}) x {layout.nproc} ranks"
                     if sim is not None else f"this host, {layout.nproc} ranks")
            print(f"{desc}: {where}", file=sys.stderr, flush=True)
            commd_rows = run_commd_phase(layout, spec, sim, work, bar, deadline)
            meta, rows = dict(commd_rows.meta or {}), list(commd_rows.rows)
            if "mpi" in spec.compare:
                mpi_rows = run_mpi_phase(layout, spec, sim, work, bar, deadline)
                rows += mpi_rows.rows
                meta["paths"] = [*meta.get("paths", []), "mpi"]
        ok = True
    except BenchError as exc:
        raise BenchError(f"{exc}\n(all logs of this run are kept in {work})") from None
    finally:
        bar.close()
        if ok:
            shutil.rmtree(work, ignore_errors=True)
    warning = watch.finish(time.monotonic() - started)
    if warning:
        print(f"{desc}: {warning}", file=sys.stderr, flush=True)
    meta["load"] = watch.to_json()
    return meta, rows
