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
from pathlib import Path

from commd.algorithms.catalog import ENV_DIR, Catalog, resolve_dir
from commd.daemon import notify
from commd.daemon.args import add_arguments, fabric_spec, fusion_settings, load_table, tuning_path
from commd.daemon.cuda import gpu_device_present
from commd.daemon.limits import config_section, limits_from_args
from commd.daemon.node import Daemon, DaemonConfig
from commd.execution import torch_loader
from commd.observe import cli as observe
from commd.observe import gcpauses
from commd.runtime import (
    ConfigError,
    JobPaths,
    env_bytes,
    env_float,
    env_int,
    new_secret,
    secret_from_environment,
)
from commd.scheduler.config import SchedulerConfig, load_config

NODE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


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
        max_registered_bytes = env_bytes("COMMD_MAX_REGISTERED_BYTES", _physical_memory() // 2, 0, 1 << 50)
        warm_up_torch = bool(env_int("COMMD_TORCH_WARMUP", 1, 0, 1))
        freeze_gc = bool(env_int("COMMD_GC_FREEZE", 1, 0, 1))
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
        fusion_settings(args, scheduler)
        try:
            algorithms_dir = resolve_dir(args.algorithms_dir, scheduler.algorithms_dir)
        except ValueError as exc:
            raise ConfigError(f"--algorithms-dir / ${ENV_DIR} / [scheduler] algorithms_dir: {exc}") from None
        metrics, trace = observe.daemon_settings(args, config_path)
        spec = fabric_spec(args, node_name, op_timeout)
        if spec is not None and spec.node_rank in (0, None):  # node 0 loads (MPI: not known yet, all do)
            table_path, explicit = tuning_path(args, scheduler, node_name, spec.nnodes)
            if table_path is not None:
                scheduler.table, scheduler.tuning_note = load_table(table_path, explicit)
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
    gcpauses.PAUSES.install()
    gcpauses.configure(freeze=freeze_gc)
    fabric = None
    if spec is not None:
        torch_loader.torch_module()  # the fabric's lanes and kernels use torch directly
        from commd.fabric.rendezvous import FabricError, establish

        catalog = _catalog(algorithms_dir)
        try:
            fabric = establish(spec, paths.job, given_secret, scheduler,
                               catalog.shared() if catalog is not None else None)
        except FabricError as exc:
            logging.getLogger("commd.daemon").error("cannot form the fabric: %s", exc)
            print(f"commd daemon: cannot form the fabric: {exc}", file=sys.stderr)
            return 1
        secret = fabric.secret
        fabric.catalog = catalog
        if catalog is not None and not fabric.is_coordinator:
            catalog.adopt(fabric.programs)  # node 0's user programs, each checked here too
        scheduler = fabric.config or scheduler
        # Every node checks the coordinator's table against its own fabric (same verdict everywhere).
        scheduler.adopt_table(scheduler.table, fabric.nnodes, sorted(fabric.lanes))
        logging.getLogger("commd.daemon").info("lane choice: %s", scheduler.tuning_note)
        gcpauses.freeze_heap()  # the lanes, the catalogue's programs: set up once, alive until the end
    config = DaemonConfig(
        paths=paths, secret=secret, op_timeout=op_timeout,
        exit_when_idle=args.exit_when_idle, idle_grace=args.idle_grace,
        first_client_grace=args.first_client_grace, owner_pid=args.owner_pid,
        node_name=node_name, scheduler=scheduler, fabric=fabric, peer_timeout=peer_timeout, limits=limits,
        metrics=metrics, trace=trace, max_segments=max_segments, max_arena_bytes=max_arena_bytes,
        max_registered_bytes=max_registered_bytes,
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


def _catalog(directory: Path | None) -> Catalog | None:
    """This node's programs (library and ``directory``'s files, checked); None, said in the log,
    when the program stages cannot be loaded (every algorithm hint then fails with that reason)."""
    try:
        return Catalog(directory)
    except ImportError as exc:
        logging.getLogger("commd.daemon").warning("collective programs unavailable: %s", exc)
        return None


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="commd daemon", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
