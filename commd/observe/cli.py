"""The daemon's metrics and trace flags (``commd daemon --metrics-port ... --trace FILE``).

Defined next to the settings they resolve (``observe.settings``,
``observe.trace``), so the daemon's argument parser and the config file read
the same defaults.  The ``commd trace`` command, which talks to a running
daemon, is in ``commd.cli.trace``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from commd.observe import settings
from commd.observe.trace import TraceError, check_trace_path
from commd.runtime import ConfigError


# ---- the daemon's flags -------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("metrics and tracing (off by default)")
    group.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                       help="serve Prometheus metrics on this port, 0: any free port (default: "
                            "$COMMD_METRICS_PORT, else the config's [metrics] port, else no endpoint)")
    group.add_argument("--metrics-addr", default=None, metavar="IP",
                       help="address the metrics endpoint binds to (default: $COMMD_METRICS_ADDR, else "
                            "[metrics] addr, else 127.0.0.1)")
    group.add_argument("--metrics-textfile", default=None, metavar="PATH",
                       help="also write the metrics to PATH (atomically, for node_exporter's textfile "
                            "collector) every --metrics-interval seconds and at exit (default: "
                            "$COMMD_METRICS_TEXTFILE, else [metrics] textfile)")
    group.add_argument("--metrics-interval", type=float, default=None, metavar="SECONDS",
                       help="textfile refresh period (default: $COMMD_METRICS_INTERVAL, else "
                            f"[metrics] interval_s, else {settings.DEFAULT_TEXTFILE_INTERVAL_S:g})")
    group.add_argument("--trace", default=None, metavar="FILE",
                       help="write every op's phases to FILE as Chrome/Perfetto trace JSON from the start "
                            "(in a fabric node k writes FILE's stem + '.node<k>'; default: $COMMD_TRACE)")


def daemon_settings(args: argparse.Namespace, config_path: str | None
                    ) -> tuple[settings.MetricsSettings, str | None]:
    """The metrics settings and the trace file for ``commd daemon`` (raises ConfigError)."""
    metrics = settings.resolve(args.metrics_port, args.metrics_addr, args.metrics_textfile,
                               args.metrics_interval, config_path)
    trace = args.trace if args.trace is not None else (os.environ.get("COMMD_TRACE") or None)
    if trace is not None:
        try:
            trace = check_trace_path(str(Path(trace).expanduser().absolute()),
                                     "--trace" if args.trace is not None else "COMMD_TRACE")
        except TraceError as exc:
            raise ConfigError(str(exc)) from None
    return metrics, trace
