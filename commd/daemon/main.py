"""`commd daemon`: start one node daemon for a job (foreground)."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import re
import socket
import sys

from commd.daemon import notify
from commd.daemon.cuda import gpu_device_present
from commd.daemon.limits import add_limit_arguments, config_section, limits_from_args
from commd.daemon.node import Daemon, DaemonConfig
from commd.execution import torch_loader
from commd.fabric.rendezvous import FabricSpec, parse_host_port
from commd.observe import cli as observe
from commd.runtime import (
    ConfigError,
    JobPaths,
    env_bytes,
    env_float,
    env_int,
    new_secret,
    secret_from_environment,
)
from commd.scheduler.selection import SchedulerConfig, load_config
from commd.scheduler.tuning import TuningTable

NODE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--job", help="job name (default: $COMMD_JOB or 'default')")
    parser.add_argument(
        "--op-timeout", type=float, default=None,
        help="seconds an op may wait for its peers (default: $COMMD_OP_TIMEOUT or 30)",
    )
    parser.add_argument(
        "--exit-when-idle", action="store_true",
        help="exit once the job's last client has left (used when auto-started)",
    )
    parser.add_argument("--idle-grace", type=float, default=3.0, help="seconds idle before --exit-when-idle exits")
    parser.add_argument(
        "--first-client-grace", type=float, default=60.0,
        help="with --exit-when-idle: exit if no client has connected this many seconds after the daemon "
             "started serving (whoever started it is gone; default 60)",
    )
    parser.add_argument(
        "--owner-pid", type=int, default=None,
        help="exit (as on SIGTERM) when this process dies, e.g. the launcher that started us",
    )
    fabric = parser.add_argument_group(
        "multi-node fabric (one daemon per node)",
        "With a store rendezvous every node needs the same job secret: COMMD_SECRET, or COMMD_SECRET_FILE "
        "naming a file of yours with mode 0600 (never published in the store). Under mpiexec none is needed.",
    )
    fabric.add_argument("--nnodes", type=int, default=None,
                        help="number of nodes (daemons) in the job (default: $COMMD_NNODES or 1)")
    fabric.add_argument("--node-rank", type=int, default=None,
                        help="this node's rank in [0, nnodes) (default: $COMMD_NODE_RANK)")
    fabric.add_argument("--rendezvous", default=None, metavar="HOST:PORT",
                        help="TCPStore for the daemons' rendezvous; node 0 hosts it unless --join-store "
                             "(default: $COMMD_RENDEZVOUS)")
    fabric.add_argument("--join-store", action="store_true",
                        help="the store at --rendezvous already exists (the training job's): only connect")
    fabric.add_argument("--node-name", default=None,
                        help="this node's name (default: $COMMD_NODE, else the hostname); unique per node")
    fabric.add_argument("--advertise", default=None, metavar="IP",
                        help="address other daemons reach this one at (default: the route to the rendezvous)")
    fabric.add_argument("--mpi", action="store_true",
                        help="form the fabric from the MPI world (implied when started by mpiexec with >1 rank)")
    fabric.add_argument("--rendezvous-timeout", type=float, default=None,
                        help="seconds to wait for every node (default: $COMMD_RENDEZVOUS_TIMEOUT or 300)")
    fabric.add_argument("--peer-timeout", type=float, default=None,
                        help="seconds of silence before a peer daemon counts as dead (default: "
                             "$COMMD_PEER_TIMEOUT or 10)")
    parser.add_argument("--config", default=None,
                        help="TOML file: [scheduler] settings and [[rules]] lane rules (default: $COMMD_CONFIG)")
    tuning = parser.add_argument_group("lane choice and fusion")
    tuning.add_argument("--tuning", default=None, metavar="PATH|off",
                        help="tuning table written by `commd tune` (default: $COMMD_TUNING, else the config's "
                             "[scheduler] tuning, else the default location for node 0's name and the node count; "
                             "'off': none)")
    tuning.add_argument("--fusion-threshold", type=int, default=None, metavar="BYTES",
                        help="fuse small all-reduces released together up to this many bytes; 0 disables "
                             "(default: $COMMD_FUSION_THRESHOLD, else the config, else 65536)")
    tuning.add_argument("--fusion-cycle-ms", type=float, default=None, metavar="MS",
                        help="collect ready ops this long before reporting them (default: "
                             "$COMMD_FUSION_CYCLE_MS, else the config, else 0: once per loop turn)")
    add_limit_arguments(parser)
    observe.add_arguments(parser)
    parser.add_argument("--log-file", default=None, help="also append the log to this file")
    parser.add_argument("--log-level", default=os.environ.get("COMMD_LOG_LEVEL", "INFO"))


#: When a daemon loads torch in the background if no trigger came earlier (every local rank
#: connected, an op that needs it): ranks that connect at once never meet the import.
TORCH_WARM_UP_AFTER_S = 1.0


def run(args: argparse.Namespace) -> int:
    try:
        paths = JobPaths.for_job(args.job).ensure()
        op_timeout = args.op_timeout if args.op_timeout is not None else env_float(
            "COMMD_OP_TIMEOUT", 30.0, 0.001, 7 * 24 * 3600
        )
        if not 0.001 <= op_timeout <= 7 * 24 * 3600:
            raise ConfigError(f"--op-timeout {op_timeout} must lie in [0.001, 604800] seconds")
        limits = limits_from_args(args, op_timeout, config_section(args.config or os.environ.get("COMMD_CONFIG")))
        threads = env_int("COMMD_KERNEL_THREADS", 1, 1, 1024)
        max_segments = env_int("COMMD_MAX_SEGMENTS", 1024, 1, 1 << 20)
        max_arena_bytes = env_bytes("COMMD_MAX_ARENA_BYTES", _physical_memory(), 1 << 16, 1 << 50)
        warm_up_torch = bool(env_int("COMMD_TORCH_WARMUP", 1, 0, 1))
        if args.idle_grace < 0:
            raise ConfigError("--idle-grace must be non-negative")
        if not 0 < args.first_client_grace <= 7 * 24 * 3600:
            raise ConfigError(f"--first-client-grace {args.first_client_grace} must lie in (0, 604800] seconds")
        if args.owner_pid is not None and args.owner_pid <= 0:
            raise ConfigError(f"--owner-pid {args.owner_pid} is not a process id")
        level = getattr(logging, str(args.log_level).upper(), None)
        if not isinstance(level, int):
            raise ConfigError(f"unknown log level {args.log_level!r}")
        node_name = args.node_name or os.environ.get("COMMD_NODE") or socket.gethostname()
        if not NODE_NAME.match(node_name):
            raise ConfigError(f"node name {node_name!r} is invalid: use 1-64 letters, digits, '_', '.', '-'")
        config_path = args.config or os.environ.get("COMMD_CONFIG")
        try:
            scheduler = load_config(config_path) if config_path else SchedulerConfig()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        _fusion_settings(args, scheduler)
        metrics, trace = observe.daemon_settings(args, config_path)
        spec = _fabric_spec(args, node_name, op_timeout)
        if spec is not None and spec.node_rank in (0, None):  # node 0 loads (MPI: not known yet, all do)
            table_path, explicit = _tuning_path(args, scheduler, node_name, spec.nnodes)
            if table_path is not None:
                scheduler.table, scheduler.tuning_note = _load_table(table_path, explicit)
        peer_timeout = args.peer_timeout if args.peer_timeout is not None else env_float(
            "COMMD_PEER_TIMEOUT", 10.0, 0.5, 3600)
        if not 0.5 <= peer_timeout <= 3600:
            raise ConfigError(f"--peer-timeout {peer_timeout} must lie in [0.5, 3600] seconds")
        # The secret comes from the environment (COMMD_SECRET, or the 0600 file COMMD_SECRET_FILE
        # names) when the user or a launcher gave one; never from argv, which /proc shows everyone.
        given_secret = secret_from_environment(consume=True)
    except ConfigError as exc:
        print(f"commd daemon: {exc}", file=sys.stderr)
        return 2
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if args.log_file:
        handlers.append(logging.FileHandler(args.log_file))
    logging.basicConfig(
        level=level, format="%(asctime)s commd-daemon[%(process)d] %(levelname)s %(message)s", handlers=handlers,
    )
    _report_fatal_signals(args.log_file)
    _raise_descriptor_limit()
    existing = paths.daemon_pid()
    if existing is not None and existing != os.getpid():
        print(f"commd daemon: job {paths.job!r} already has a daemon (pid {existing})", file=sys.stderr)
        return 1
    secret = given_secret or new_secret()
    # One kernel thread by default: the node's cores are shared with the ranks,
    # and torch's thread pool stalls on every parallel section when they are
    # oversubscribed (measured: 64 MiB add+copy 33 ms with 1 thread, >1 s with 2).
    torch_loader.configure(threads, warm_up_torch)
    fabric = None
    if spec is not None:
        torch_loader.torch_module()  # the fabric's lanes and kernels use torch directly
        from commd.fabric.rendezvous import FabricError, establish

        try:
            fabric = establish(spec, paths.job, given_secret, scheduler)
        except FabricError as exc:
            logging.getLogger("commd.daemon").error("cannot form the fabric: %s", exc)
            print(f"commd daemon: cannot form the fabric: {exc}", file=sys.stderr)
            return 1
        secret = fabric.secret
        scheduler = fabric.config or scheduler
        # Every node checks the coordinator's table against its own fabric (same verdict everywhere).
        scheduler.adopt_table(scheduler.table, fabric.nnodes, sorted(fabric.lanes))
        logging.getLogger("commd.daemon").info("lane choice: %s", scheduler.tuning_note)
    config = DaemonConfig(
        paths=paths, secret=secret, op_timeout=op_timeout,
        exit_when_idle=args.exit_when_idle, idle_grace=args.idle_grace,
        first_client_grace=args.first_client_grace, owner_pid=args.owner_pid,
        node_name=node_name, scheduler=scheduler, fabric=fabric, peer_timeout=peer_timeout, limits=limits,
        metrics=metrics, trace=trace, max_segments=max_segments, max_arena_bytes=max_arena_bytes,
    )
    daemon = Daemon(config)
    daemon.bind()
    notify.ready(paths.job)  # clients can connect from here on (systemd Type=notify)
    if gpu_device_present():  # clients' hellos ask whether torch sees a GPU: load it before they come
        torch_loader.warm_up()
    else:
        torch_loader.warm_up_later(TORCH_WARM_UP_AFTER_S)
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop is a dependency
        runner = asyncio.Runner()
    with runner:
        runner.run(daemon.run())
    return 0


def _physical_memory() -> int:
    """The machine's memory in bytes: a client's segments cannot sensibly exceed it."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # pragma: no cover - Linux has both
        return 1 << 40


def _report_fatal_signals(log_file: str | None) -> None:
    """A SIGSEGV/SIGBUS/SIGFPE/SIGABRT/SIGILL in the daemon prints every thread's stack to its log.

    The log is stderr (daemon.log when a client or launcher started us) or ``--log-file``:
    without this a daemon killed by a signal leaves no line anywhere.
    """
    target = open(log_file, "a") if log_file else sys.stderr  # noqa: SIM115 - lives as long as the process
    faulthandler.enable(file=target, all_threads=True)


def _raise_descriptor_limit() -> None:
    """Soft descriptor limit up to the hard one: every client holds several descriptors here."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError) as exc:  # pragma: no cover - best effort
        logging.getLogger("commd.daemon").debug("cannot raise the descriptor limit: %s", exc)


def _fusion_settings(args: argparse.Namespace, scheduler: SchedulerConfig) -> None:
    """Flags, then environment, override the config file's fusion settings."""
    from commd.scheduler.selection import MAX_FUSION_CYCLE_MS, MAX_FUSION_THRESHOLD

    threshold = args.fusion_threshold
    if threshold is None and os.environ.get("COMMD_FUSION_THRESHOLD"):
        threshold = env_int("COMMD_FUSION_THRESHOLD", 0, 0, MAX_FUSION_THRESHOLD)
    if threshold is not None:
        if not 0 <= threshold <= MAX_FUSION_THRESHOLD:
            raise ConfigError(f"--fusion-threshold {threshold} must lie in [0, {MAX_FUSION_THRESHOLD}] bytes")
        scheduler.fusion_threshold_bytes = threshold
    cycle = args.fusion_cycle_ms
    if cycle is None and os.environ.get("COMMD_FUSION_CYCLE_MS"):
        cycle = env_float("COMMD_FUSION_CYCLE_MS", 0.0, 0.0, MAX_FUSION_CYCLE_MS)
    if cycle is not None:
        if not 0 <= cycle <= MAX_FUSION_CYCLE_MS:
            raise ConfigError(f"--fusion-cycle-ms {cycle} must lie in [0, {MAX_FUSION_CYCLE_MS:g}]")
        scheduler.fusion_cycle_ms = cycle


def _tuning_path(
    args: argparse.Namespace, scheduler: SchedulerConfig, node_name: str, nnodes: int | None
) -> tuple[str | None, bool]:
    """Where node 0 reads its tuning table (None: none) and whether the user named it."""
    from commd.scheduler.tuning import default_table_path

    for given in (args.tuning, os.environ.get("COMMD_TUNING"), scheduler.tuning):
        if given:
            return (None, True) if given == "off" else (given, True)
    if nnodes is None:  # an MPI start learns the node count from the world
        from commd.lanes.mpi_env import mpi_world_size_from_env

        nnodes = mpi_world_size_from_env()
    return (str(default_table_path(node_name, nnodes)), False) if nnodes else (None, False)


def _load_table(path: str, explicit: bool) -> tuple[TuningTable | None, str]:
    """The table at ``path``; a named file that cannot be used is an error, a default one only a warning."""
    if not explicit and not os.path.exists(path):
        return None, f"no tuning table (none at the default location {path}); using the default lane choice"
    try:
        return TuningTable.load(path), ""
    except ValueError as exc:
        if explicit:
            raise ConfigError(str(exc)) from None
        logging.getLogger("commd.daemon").warning("ignoring %s", exc)
        return None, f"ignored the table at {path}: {exc}; using the default lane choice"


def _fabric_spec(args: argparse.Namespace, node_name: str, op_timeout: float) -> FabricSpec | None:
    """None for a single-node daemon; else what the rendezvous needs (validated)."""
    from commd.lanes.mpi_env import mpi_world_size_from_env

    # Cluster start-up (systemd EnvironmentFile, job prologue) sets these instead of flags.
    if args.nnodes is None and os.environ.get("COMMD_NNODES"):
        args.nnodes = env_int("COMMD_NNODES", 1, 1, 4096)
    if args.node_rank is None and os.environ.get("COMMD_NODE_RANK"):
        args.node_rank = env_int("COMMD_NODE_RANK", 0, 0, 4095)
    if args.rendezvous is None and os.environ.get("COMMD_RENDEZVOUS"):
        args.rendezvous = os.environ["COMMD_RENDEZVOUS"]
    mpi_size = mpi_world_size_from_env()
    use_mpi = args.mpi or (mpi_size is not None and mpi_size > 1)
    if not use_mpi and args.rendezvous is None:
        if args.nnodes not in (None, 1):
            raise ConfigError("--nnodes > 1 needs --rendezvous HOST:PORT (or a start by mpiexec)")
        return None
    if args.nnodes is not None and not 1 <= args.nnodes <= 4096:
        raise ConfigError(f"--nnodes must lie in [1, 4096], got {args.nnodes}")
    if not use_mpi:
        if args.nnodes is None or args.node_rank is None:
            raise ConfigError("--rendezvous needs --nnodes and --node-rank")
        if not 0 <= args.node_rank < args.nnodes:
            raise ConfigError(f"--node-rank {args.node_rank} must lie in [0, {args.nnodes})")
        if args.nnodes == 1:
            return None
    rendezvous = None
    if args.rendezvous is not None:
        try:
            rendezvous = parse_host_port(args.rendezvous, "--rendezvous")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    timeout = args.rendezvous_timeout if args.rendezvous_timeout is not None else env_float(
        "COMMD_RENDEZVOUS_TIMEOUT", 300.0, 1.0, 86400)
    if not 1.0 <= timeout <= 86400:
        raise ConfigError(f"--rendezvous-timeout {timeout} must lie in [1, 86400] seconds")
    if args.advertise is not None:
        try:
            socket.inet_aton(args.advertise)
        except OSError:
            raise ConfigError(f"--advertise {args.advertise!r} is not an IPv4 address") from None
    return FabricSpec(
        nnodes=args.nnodes, node_rank=args.node_rank, node_name=node_name, rendezvous=rendezvous,
        join_store=args.join_store, use_mpi=use_mpi, advertise=args.advertise, timeout=timeout,
        op_timeout=op_timeout,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="commd daemon", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
