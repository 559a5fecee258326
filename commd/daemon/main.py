"""`commd daemon`: start one node daemon for a job (foreground)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from commd.daemon.server import Daemon, DaemonConfig
from commd.runtime import ConfigError, JobPaths, env_float, env_int, new_secret

SECRET_ENV = "COMMD_SECRET"


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
        "--owner-pid", type=int, default=None,
        help="exit (as on SIGTERM) when this process dies, e.g. the launcher that started us",
    )
    parser.add_argument("--log-file", default=None, help="also append the log to this file")
    parser.add_argument("--log-level", default=os.environ.get("COMMD_LOG_LEVEL", "INFO"))


def run(args: argparse.Namespace) -> int:
    try:
        paths = JobPaths.for_job(args.job).ensure()
        op_timeout = args.op_timeout if args.op_timeout is not None else env_float(
            "COMMD_OP_TIMEOUT", 30.0, 0.001, 7 * 24 * 3600
        )
        if not 0.001 <= op_timeout <= 7 * 24 * 3600:
            raise ConfigError(f"--op-timeout {op_timeout} must lie in [0.001, 604800] seconds")
        threads = env_int("COMMD_KERNEL_THREADS", 1, 1, 1024)
        if args.idle_grace < 0:
            raise ConfigError("--idle-grace must be non-negative")
        if args.owner_pid is not None and args.owner_pid <= 0:
            raise ConfigError(f"--owner-pid {args.owner_pid} is not a process id")
        level = getattr(logging, str(args.log_level).upper(), None)
        if not isinstance(level, int):
            raise ConfigError(f"unknown log level {args.log_level!r}")
    except ConfigError as exc:
        print(f"commd daemon: {exc}", file=sys.stderr)
        return 2
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if args.log_file:
        handlers.append(logging.FileHandler(args.log_file))
    logging.basicConfig(
        level=level, format="%(asctime)s commd-daemon[%(process)d] %(levelname)s %(message)s", handlers=handlers,
    )
    existing = paths.daemon_pid()
    if existing is not None and existing != os.getpid():
        print(f"commd daemon: job {paths.job!r} already has a daemon (pid {existing})", file=sys.stderr)
        return 1
    # The secret comes from the environment when a launcher agreed on it
    # (never from argv: argv is world-readable in /proc).
    secret = os.environ.pop(SECRET_ENV, None) or new_secret()
    # One kernel thread by default: the node's cores are shared with the ranks,
    # and torch's thread pool stalls on every parallel section when they are
    # oversubscribed (measured: 64 MiB add+copy 33 ms with 1 thread, >1 s with 2).
    import torch

    torch.set_num_threads(threads)
    config = DaemonConfig(
        paths=paths, secret=secret, op_timeout=op_timeout,
        exit_when_idle=args.exit_when_idle, idle_grace=args.idle_grace, owner_pid=args.owner_pid,
    )
    daemon = Daemon(config)
    daemon.bind()
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop is a dependency
        runner = asyncio.Runner()
    with runner:
        runner.run(daemon.run())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="commd daemon", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
