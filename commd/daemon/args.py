"""`commd daemon`'s settings: its flags, and how flags, environment and config file combine.

Flags win over the environment (``COMMD_*``), which wins over the config file; every
value is checked here, before anything starts, and a bad one is a ``ConfigError``
naming the flag or variable.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket

from commd.daemon.limits import add_limit_arguments
from commd.fabric.rendezvous import FabricSpec, parse_host_port
from commd.observe import cli as observe
from commd.runtime import ConfigError, env_float, env_int
from commd.scheduler.config import SchedulerConfig
from commd.scheduler.tuning import TuningTable


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
    tuning.add_argument("--algorithms-dir", default=None, metavar="DIR",
                        help="collective programs (MSCCL XML files, checked at load) this node can run "
                             "(default: $COMMD_ALGORITHMS_DIR, else the config's [scheduler] algorithms_dir)")
    tuning.add_argument("--fusion-threshold", type=int, default=None, metavar="BYTES",
                        help="fuse small all-reduces released together up to this many bytes; 0 disables "
                             "(default: $COMMD_FUSION_THRESHOLD, else the config, else 65536)")
    tuning.add_argument("--fusion-cycle-ms", type=float, default=None, metavar="MS",
                        help="collect ready ops this long before reporting them (default: "
                             "$COMMD_FUSION_CYCLE_MS, else the config, else 0: once per loop turn)")
    add_limit_arguments(parser)
    observe.add_arguments(parser)
    parser.add_argument("--log-file", default=None, help="also append the log to this file")
    parser.add_argument("--log-level", default=os.environ.get("COMMD_LOG_LEVEL", "INFO"),
                        help="a logging level: DEBUG, INFO, WARNING, ERROR, CRITICAL (default: $COMMD_LOG_LEVEL, "
                             "else INFO)")


def fusion_settings(args: argparse.Namespace, scheduler: SchedulerConfig) -> None:
    """Flags, then environment, override the config file's fusion settings."""
    from commd.scheduler.config import MAX_FUSION_CYCLE_MS, MAX_FUSION_THRESHOLD

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
    if os.environ.get("COMMD_CONTROL_FANOUT"):
        from commd.scheduler.config import MAX_CONTROL_FANOUT

        scheduler.control_fanout = env_int("COMMD_CONTROL_FANOUT", 0, 2, MAX_CONTROL_FANOUT)


def tuning_path(
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


def load_table(path: str, explicit: bool) -> tuple[TuningTable | None, str]:
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


def fabric_spec(args: argparse.Namespace, node_name: str, op_timeout: float) -> FabricSpec | None:
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
