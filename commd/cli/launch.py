"""`commd launch`: start the node daemon, then N training processes (torchrun-style).

The launcher owns the daemon (started first, with ``exit_when_idle=False``,
stopped last) so workers never race to start one, and it owns the workers:
signals are forwarded to them, and the first worker that fails takes the
others down with it so a job never hangs on a dead peer.  Workers see the
same environment torchrun gives them (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, GROUP_RANK...) plus COMMD_JOB,
which makes ``init_process_group("commd")`` use the launcher's daemon.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

from commd.cli.rank_output import DRAIN_TIMEOUT_S, RankOutput
from commd.client.errors import ConnectError
from commd.client.spawn import SECRET_ENV, ping, start_daemon
from commd.memory.budget import check_environment
from commd.runtime import ConfigError, JobPaths, check_job, free_port, new_secret, secret_from_environment

POLL_S = 0.05
DEFAULT_GRACE_S = 10.0
DAEMON_START_TIMEOUT_S = 60.0
#: A multi-node daemon waits in its rendezvous until every node's daemon started.
MULTI_NODE_START_TIMEOUT_S = 300.0
DAEMON_STOP_TIMEOUT_S = 20.0


class LaunchError(Exception):
    """The launch cannot go ahead (bad arguments, daemon would not start)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc-per-node", "--nproc_per_node", dest="nproc", type=int, default=1, metavar="N",
        help="number of worker processes on this node (default 1)",
    )
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes in the job (default 1)")
    parser.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0,
                        help="this node's rank in [0, nnodes) (default 0)")
    parser.add_argument("--master", default=None, metavar="ADDR:PORT",
                        help="node 0's address and a free port: node 0's launcher hosts the job's store "
                             "there; needed when --nnodes > 1 (sets --master-addr/--master-port)")
    parser.add_argument("--node-name", default=None,
                        help="this node's name (default: $COMMD_NODE, else the hostname)")
    parser.add_argument("--job", help="job name (default: a fresh unique name); an already running "
                        "daemon for this job is reused and left running")
    parser.add_argument("--master-addr", "--master_addr", dest="master_addr", default="127.0.0.1",
                        help="MASTER_ADDR for the workers (default 127.0.0.1)")
    parser.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=None,
                        help="MASTER_PORT for the workers (default: a free port)")
    parser.add_argument("--op-timeout", type=float, default=None,
                        help="seconds an op may wait for its peers (passed to the daemon)")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="trace every op's phases into FILE (Chrome/Perfetto JSON; in a multi-node job "
                             "node k writes FILE's stem + '.node<k>'; join them with `commd trace merge`); "
                             "every op is traced, the exchange rings' all-reduces too")
    parser.add_argument("--record", default=None, metavar="DIR",
                        help="every rank writes the ops it submits through the commd backend as a PARAM comms "
                             "trace, DIR/rank<R>.json (COMMD_RECORD); replay them with `commd replay DIR`")
    parser.add_argument("--keep-going", action="store_true",
                        help="a worker that fails does not stop the others: for training loops under "
                             "commd.ft.Guard, whose survivors go on without it.  The launcher hosts the job's "
                             "store (so any rank may die) and exits 0 once every worker has exited, if one "
                             "of them finished cleanly")
    parser.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=0, metavar="N",
                        help="a worker that fails is started again, with the same rank, up to N times per rank "
                             "(implies --keep-going): under commd.ft.Guard the replacement rejoins the running "
                             "job and receives the model and optimizer state from the others (default 0)")
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE_S,
                        help="seconds workers get after SIGTERM before SIGKILL (default 10)")
    parser.add_argument("--no-prefix", dest="prefix", action="store_false",
                        help="leave the workers' output as it is (default: each line starts with [rankN]:)")
    parser.add_argument("--local-ranks-filter", default=None, metavar="RANKS",
                        help="show the standard output of these local ranks only, e.g. 0 or 0,3 "
                             "(the others' standard error is still shown)")
    parser.add_argument("-m", "--module", action="store_true",
                        help="treat the script as a module name and run it with `python -m`")
    parser.add_argument("script", help="training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def _validate(args: argparse.Namespace) -> None:
    if args.nproc < 1:
        raise LaunchError(f"--nproc-per-node must be at least 1, got {args.nproc}")
    if not 1 <= args.nnodes <= 4096:
        raise LaunchError(f"--nnodes must lie in [1, 4096], got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise LaunchError(f"--node-rank {args.node_rank} must lie in [0, {args.nnodes})")
    if args.master is not None:
        from commd.fabric.rendezvous import parse_host_port

        try:
            args.master_addr, args.master_port = parse_host_port(args.master, "--master")
        except ValueError as exc:
            raise LaunchError(str(exc)) from None
    elif args.nnodes > 1:
        raise LaunchError("--nnodes > 1 needs --master ADDR:PORT (node 0's address and a free port)")
    args.node_name = args.node_name or os.environ.get("COMMD_NODE") or socket.gethostname()
    if args.nproc > 4096:
        raise LaunchError(f"--nproc-per-node {args.nproc} is implausibly large (max 4096)")
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise LaunchError(f"--master-port must lie in [1, 65535], got {args.master_port}")
    if not args.master_addr:
        raise LaunchError("--master-addr must not be empty")
    if args.op_timeout is not None and not 0.001 <= args.op_timeout <= 7 * 24 * 3600:
        raise LaunchError(f"--op-timeout {args.op_timeout} must lie in [0.001, 604800] seconds")
    if args.grace < 0:
        raise LaunchError("--grace must be non-negative")
    if not 0 <= args.max_restarts <= 1000:
        raise LaunchError(f"--max-restarts must lie in [0, 1000], got {args.max_restarts}")
    if args.max_restarts:
        args.keep_going = True
    if args.trace is not None:
        from commd.observe.trace import TraceError, check_trace_path

        try:
            args.trace = check_trace_path(str(Path(args.trace).expanduser().absolute()), "--trace")
        except TraceError as exc:
            raise LaunchError(str(exc)) from None
    if args.record is not None:
        record = Path(args.record).expanduser().absolute()
        try:
            record.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise LaunchError(f"--record {args.record}: cannot create the directory: {exc.strerror or exc}") from None
        args.record = str(record)
    if args.module:
        if not all(part.isidentifier() for part in args.script.split(".")):
            raise LaunchError(f"-m: {args.script!r} is not a module name")
        if not _module_exists(args.script.split(".")[0]):
            raise LaunchError(f"no such module: {args.script!r} (python -m would not find it from {os.getcwd()})")
    else:
        script = Path(args.script)
        if not script.exists():
            raise LaunchError(f"no such script: {args.script!r} (from {os.getcwd()})")
        if not script.is_file():
            raise LaunchError(f"script {args.script!r} is not a file")
    args.shown_ranks = _parse_ranks_filter(args.local_ranks_filter, args.nproc)
    if args.job is not None:
        try:
            check_job(args.job)
        except ConfigError as exc:
            raise LaunchError(str(exc)) from None


def _module_exists(top: str) -> bool:
    """Whether ``python -m`` in this directory finds the top-level package ``top`` (nothing is imported)."""
    import importlib.machinery
    import importlib.util

    if importlib.machinery.PathFinder.find_spec(top, [os.getcwd()]) is not None:
        return True
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


def _parse_ranks_filter(text: str | None, nproc: int) -> set[int] | None:
    """--local-ranks-filter as a set of local ranks (None: all)."""
    if text is None:
        return None
    try:
        ranks = {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        raise LaunchError(f"--local-ranks-filter {text!r} must list local ranks, e.g. 0 or 0,3") from None
    bad = sorted(r for r in ranks if not 0 <= r < nproc)
    if not ranks or bad:
        raise LaunchError(f"--local-ranks-filter {text!r}: local ranks must lie in [0, {nproc})")
    return ranks


def worker_env(
    base: dict[str, str], rank: int, nproc: int, job: str, master_addr: str, master_port: int,
    node_rank: int = 0, nnodes: int = 1, node_name: str | None = None,
) -> dict[str, str]:
    """The environment torchrun gives local rank ``rank`` of node ``node_rank``, plus COMMD_JOB."""
    env = dict(base)
    env.pop(SECRET_ENV, None)  # workers read the secret from the private job dir
    world = nproc * nnodes
    global_rank = node_rank * nproc + rank
    env.update(
        RANK=str(global_rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK=str(node_rank), GROUP_WORLD_SIZE=str(nnodes), ROLE_RANK=str(global_rank),
        ROLE_WORLD_SIZE=str(world), ROLE_NAME="default", MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
        COMMD_JOB=job,
    )
    if node_name is not None:
        env["COMMD_NODE"] = node_name
    if nnodes > 1:
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # the launcher hosts the store, as torchrun's agent does
    if nproc > 1 and "OMP_NUM_THREADS" not in base:
        # Same default as torchrun: N workers each using every core thrash the machine.
        env["OMP_NUM_THREADS"] = "1"
    return env


@dataclass
class Worker:
    rank: int
    proc: subprocess.Popen
    outputs: list[RankOutput] = field(default_factory=list)
    global_rank: int = 0
    #: how many times this rank was started again before this process (--max-restarts)
    restarts: int = 0
    #: when the launcher first saw it exited (the first failure is the one to report: the others'
    #: errors are most often its consequence, a peer that died)
    exited_at: float | None = None

    @property
    def code(self) -> int | None:
        return self.proc.poll()


def exit_code(returncode: int) -> int:
    """A shell-style exit status: 128+N for a worker killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def stop_process(proc: subprocess.Popen, grace: float, sig: int = signal.SIGTERM) -> int:
    """Send ``sig``, wait up to ``grace`` seconds, then SIGKILL; returns the exit code."""
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
    try:
        return proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
        return -signal.SIGKILL


def stop_daemon(proc: subprocess.Popen, timeout: float = DAEMON_STOP_TIMEOUT_S) -> int:
    """SIGTERM the launcher-owned daemon and wait (bounded) for its clean shutdown."""
    return stop_process(proc, timeout)


def stop_workers(workers: list[Worker], grace: float, sig: int | None = signal.SIGTERM) -> None:
    """Signal every live worker at once (unless ``sig`` is None: already signalled),
    then give them ``grace`` seconds together before SIGKILL."""
    for w in workers:
        if sig is not None and w.proc.poll() is None:
            try:
                w.proc.send_signal(sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for w in workers:
        try:
            w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for w in workers:
        if w.proc.poll() is None:
            print(f"commd launch: rank {w.rank} (pid {w.proc.pid}) ignored SIGTERM for {grace:g}s; killing it",
                  file=sys.stderr)
            w.proc.kill()
    for w in workers:
        try:
            w.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
            pass


@dataclass
class _Signals:
    """Signals received while workers run; handlers only record and forward."""

    workers: list[Worker] = field(default_factory=list)
    #: workers that failed and were started again (their output is still drained at the end)
    replaced: list[Worker] = field(default_factory=list)
    received: list[int] = field(default_factory=list)

    def handler(self, signum: int, _frame: FrameType | None) -> None:
        self.received.append(signum)
        # A second signal means "now": escalate to SIGKILL.
        sig = signal.SIGKILL if len(self.received) > 1 else signum
        for w in self.workers:
            if w.proc.poll() is None:
                try:
                    os.kill(w.proc.pid, sig)
                except ProcessLookupError:
                    pass


def _start_workers(args: argparse.Namespace, job: str, port: int, sigs: _Signals) -> None:
    for rank in range(args.nproc):
        if sigs.received:
            return
        sigs.workers.append(_start_worker(args, job, port, rank))


def _start_worker(args: argparse.Namespace, job: str, port: int, rank: int, restarts: int = 0) -> Worker:
    """Local rank ``rank``'s process (its ``restarts``-th restart)."""
    target = ["-m", args.script] if args.module else [args.script]
    env = worker_env(dict(os.environ), rank, args.nproc, job, args.master_addr, port,
                     args.node_rank, args.nnodes, args.node_name)
    if args.keep_going:  # the launcher hosts the store: a rank's death must not take it along
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    # torchrun's name too, so that a script written for it tells a restart from a first start
    env["COMMD_RESTART_COUNT"] = env["TORCHELASTIC_RESTART_COUNT"] = str(restarts)
    if args.record is not None:
        env["COMMD_RECORD"] = args.record
    shown = args.shown_ranks is None or rank in args.shown_ranks
    stdout = subprocess.PIPE if args.prefix and shown else None if shown else subprocess.DEVNULL
    stderr = subprocess.PIPE if args.prefix else None
    if args.prefix:
        env.setdefault("PYTHONUNBUFFERED", "1")  # a pipe would hold the worker's lines back
    # Own session per worker (as torchrun): a terminal Ctrl-C reaches them
    # once, through our forwarding, not twice.
    proc = subprocess.Popen(
        [sys.executable, *target, *args.script_args], env=env, start_new_session=True,
        stdout=stdout, stderr=stderr,
    )
    global_rank = args.node_rank * args.nproc + rank
    worker = Worker(rank, proc, global_rank=global_rank, restarts=restarts)
    for pipe, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
        if pipe is not None:
            worker.outputs.append(RankOutput(global_rank, pipe, sink))
    return worker


def _supervise(workers: list[Worker], sigs: _Signals, grace: float, daemon: subprocess.Popen | None,
               keep_going: bool = False, restart: Callable[[Worker], Worker | None] | None = None) -> int:
    """Wait for all workers; on the first failure stop the rest (``keep_going``: report it and wait for
    the others; ``restart``: start a failed worker again, None once its restarts are spent).
    Returns the launcher's exit code."""
    daemon_reported = False
    reported: set[int] = set()  # id() of the failed workers already dealt with
    while True:
        if sigs.received:
            stop_workers(workers, grace, None)  # the handler forwarded the signal already
            signum = sigs.received[0]
            print(f"commd launch: stopped the workers on {signal.Signals(signum).name}", file=sys.stderr)
            return 128 + signum
        now = time.monotonic()
        for w in workers:
            if w.exited_at is None and w.code is not None:
                w.exited_at = now
        failed = sorted((w for w in workers if w.code not in (None, 0)), key=lambda w: w.exited_at or now)
        if keep_going:
            for w in failed:
                if id(w) in reported:
                    continue
                reported.add(id(w))
                again = restart(w) if restart is not None and not sigs.received else None
                if again is None:
                    print(f"commd launch: rank {w.global_rank} (pid {w.proc.pid}) {describe_exit(w.proc.returncode)}; "
                          "the others go on (--keep-going)", file=sys.stderr)
                    continue
                print(f"commd launch: rank {w.global_rank} (pid {w.proc.pid}) {describe_exit(w.proc.returncode)}; "
                      f"started it again (restart {again.restarts}), pid {again.proc.pid}", file=sys.stderr)
                workers[workers.index(w)] = again
                sigs.replaced.append(w)
            if all(w.code is not None for w in workers):
                return 0 if any(w.code == 0 for w in workers) else exit_code(failed[0].proc.returncode)
            failed = []
        if failed:
            first = failed[0]
            code = first.proc.returncode
            rest = [w for w in workers if w.code is None]
            note = f"; stopping {len(rest)} other worker(s)" if rest else ""
            local = f"local rank {first.rank}, " if first.global_rank != first.rank else ""
            said = next((out.last_line for out in reversed(first.outputs) if out.last_line), "")
            print(f"commd launch: rank {first.global_rank} ({local}pid {first.proc.pid}) failed first: "
                  f"{describe_exit(code)}{': ' + said if said else ''}{note}", file=sys.stderr)
            stop_workers(rest, grace)
            return exit_code(code)
        if all(w.code == 0 for w in workers):
            return 0
        if daemon is not None and not daemon_reported and daemon.poll() is not None:
            daemon_reported = True
            print(f"commd launch: the commd daemon {describe_exit(daemon.returncode)} while workers run; "
                  "their collectives will fail", file=sys.stderr)
        time.sleep(POLL_S)


def _drain_output(workers: list[Worker]) -> None:
    """Copy what the workers wrote last; say so if a pipe stays open (a worker's child holds it)."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    for w in workers:
        for out in w.outputs:
            if not out.join(max(0.0, deadline - time.monotonic())):
                print(f"commd launch: rank {w.rank}'s output is still open after it exited "
                      "(a process it started holds it); not waiting for it", file=sys.stderr)


def _host_or_join_store(args: argparse.Namespace, job: str | None) -> tuple[Any, str, str]:
    """Multi-node: node 0 hosts the job's TCPStore (as torchrun's agent) and publishes the job name
    there; the other launchers read it.  The secret is never published (anyone who reaches the
    store's port could read it): every node's launcher must be given the same one through
    COMMD_SECRET or COMMD_SECRET_FILE.  Returns (store, job, secret)."""
    from torch.distributed import TCPStore

    try:
        secret = secret_from_environment()
    except ConfigError as exc:
        raise LaunchError(str(exc)) from None
    if secret is None:
        raise LaunchError(
            "--nnodes > 1 needs the job secret on every node: set COMMD_SECRET, or COMMD_SECRET_FILE to a "
            "file only you can read (mode 0600), to the same value on every node (e.g. `openssl rand -hex "
            "32`); commd does not send it through the job's store, which anyone reaching its port can read"
        )
    is_host = args.node_rank == 0
    try:
        store = TCPStore(args.master_addr, args.master_port, None, is_host,
                         timedelta(seconds=MULTI_NODE_START_TIMEOUT_S), wait_for_workers=False)
    except Exception as exc:
        role = "host" if is_host else "reach"
        raise LaunchError(f"cannot {role} the job's store at {args.master_addr}:{args.master_port}: {exc}") from None
    if is_host:
        job = job or f"launch-{uuid.uuid4().hex[:12]}"
        store.set("commd/launch/job", job)
    try:
        agreed = store.get("commd/launch/job").decode()
    except Exception as exc:
        raise LaunchError(f"node 0's launcher did not publish the job within the timeout: {exc}") from None
    if job is not None and job != agreed:
        raise LaunchError(f"--job {job!r} differs from node 0's job {agreed!r}")
    return store, agreed, secret


def _host_store(addr: str, port: int) -> Any:
    """One node under --keep-going: the launcher hosts the job's TCPStore (as torchrun's agent does),
    so that the store outlives any rank."""
    from torch.distributed import TCPStore

    try:
        return TCPStore(addr, port, None, True, timedelta(seconds=MULTI_NODE_START_TIMEOUT_S), wait_for_workers=False)
    except Exception as exc:
        raise LaunchError(f"cannot host the job's store at {addr}:{port}: {exc}") from None


def _start_or_reuse_daemon(
    args: argparse.Namespace, paths: JobPaths, secret: str | None = None
) -> subprocess.Popen | None:
    """Start the job's daemon (owned by us), or None to reuse one that already answers."""
    try:
        paths.ensure()  # a runtime root or job directory that is not ours is refused, never reused
    except ConfigError as exc:
        raise LaunchError(str(exc)) from None
    existing = paths.daemon_pid()
    if existing is not None and ping(paths, 2.0) == existing:
        if args.job is None:  # pragma: no cover - a fresh uuid name cannot collide
            raise LaunchError(f"job {paths.job!r} unexpectedly has a daemon")
        print(f"commd launch: using the running daemon of job {paths.job!r} (pid {existing}); "
              "it is left running afterwards", file=sys.stderr)
        if args.op_timeout is not None:
            print("commd launch: --op-timeout ignored: the daemon is already running", file=sys.stderr)
        if args.trace is not None:
            print("commd launch: --trace ignored: the daemon is already running (use `commd trace start`)",
                  file=sys.stderr)
        return None
    extra = ["--op-timeout", repr(args.op_timeout)] if args.op_timeout is not None else []
    extra += ["--owner-pid", str(os.getpid())]  # never outlive the launcher, even if it is killed
    extra += ["--node-name", args.node_name]
    if args.trace is not None:
        extra += ["--trace", args.trace]
    timeout = DAEMON_START_TIMEOUT_S
    if args.nnodes > 1:
        extra += ["--nnodes", str(args.nnodes), "--node-rank", str(args.node_rank),
                  "--rendezvous", f"{args.master_addr}:{args.master_port}", "--join-store"]
        timeout = MULTI_NODE_START_TIMEOUT_S
    try:
        return start_daemon(paths, secret or new_secret(), exit_when_idle=False, extra_args=extra,
                            timeout=timeout)
    except (ConnectError, ConfigError, OSError) as exc:
        raise LaunchError(f"cannot start the commd daemon: {exc}") from None


def run(args: argparse.Namespace) -> int:
    store = secret = None
    try:
        _validate(args)
        check_environment()  # the workers' settings, checked before any process starts
        port = args.master_port if args.master_port is not None else free_port(args.master_addr)
        if args.nnodes > 1:
            store, job, secret = _host_or_join_store(args, args.job)
        else:
            job = args.job or f"launch-{uuid.uuid4().hex[:12]}"
            if args.keep_going:
                store = _host_store(args.master_addr, port)
        paths = JobPaths.for_job(job)
    except (LaunchError, ConfigError) as exc:
        print(f"commd launch: {exc}", file=sys.stderr)
        return 2

    # Handlers go in before the daemon starts: a signal during the start is
    # recorded and acted on once start_daemon returns (it is bounded), so the
    # daemon is never orphaned by a KeyboardInterrupt.
    sigs = _Signals()
    previous = {sig: signal.signal(sig, sigs.handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    daemon: subprocess.Popen | None = None
    code = 1
    try:
        daemon = _start_or_reuse_daemon(args, paths, secret)
        if not sigs.received:
            _start_workers(args, job, port, sigs)
        def restart(worker: Worker) -> Worker | None:
            if worker.restarts >= args.max_restarts:
                return None
            return _start_worker(args, job, port, worker.rank, worker.restarts + 1)

        code = _supervise(sigs.workers, sigs, args.grace, daemon, args.keep_going, restart)
    except LaunchError as exc:
        print(f"commd launch: {exc}", file=sys.stderr)
    except OSError as exc:
        print(f"commd launch: cannot start the workers: {exc}", file=sys.stderr)
    finally:
        # Whatever happened above, no worker may outlive the launcher.
        stop_workers(sigs.workers, args.grace)
        _drain_output(sigs.replaced + sigs.workers)
        if daemon is not None:
            daemon_code = stop_daemon(daemon)
            if daemon_code != 0:
                print(f"commd launch: the commd daemon {describe_exit(daemon_code)}; "
                      f"see {paths.log_file}", file=sys.stderr)
            elif args.job is None:
                # A run under a throwaway name leaves only its log behind (pruned by later starts).
                paths.clear_keeping_log()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code != 0 and daemon is not None:
        print(f"commd launch: the daemon log of job {job!r} is {paths.log_file}", file=sys.stderr)
    del store  # the job's store (hosted or joined) lived until every worker was gone
    return code
