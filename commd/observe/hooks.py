"""The daemon's observability in one object: metrics, and the trace turned on or off.

The daemon keeps its tracer (a ``Tracer`` or a ``NullTrace``) in a plain
attribute (``NodeState.tracer``, read and written through ``daemon.tracer``) so
each op hook costs one attribute test when tracing is off; this object swaps it.  A trace started on node 0 of a fabric (``commd trace start``)
is forwarded to every node; each node writes its own file
(``trace.node<k>.json``), which ``commd trace merge`` joins.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from commd.observe.metrics import DaemonMetrics
from commd.observe.settings import MetricsSettings
from commd.observe.trace import NullTrace, TraceError, Tracer, check_trace_path, node_trace_path

log = logging.getLogger("commd.observe")

#: Control message actions (``{"t": "trace", "action": ..., "path": ...}``).
TRACE_ACTIONS = ("start", "stop")


class DaemonObservers:
    def __init__(self, daemon: Any, metrics: MetricsSettings | None, trace_path: str | None) -> None:
        self.daemon = daemon
        self.metrics = DaemonMetrics(daemon, metrics) if metrics is not None and metrics.enabled else None
        self._initial_trace = trace_path
        daemon.tracer = NullTrace()

    def _node(self) -> tuple[int | None, str]:
        fabric = self.daemon.config.fabric
        return (fabric.node_rank if fabric is not None else None), self.daemon.config.node_name

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.metrics is not None:
            try:
                self.metrics.start(loop)
            except OSError as exc:  # lost the port between the start-up check and now
                log.error("cannot serve metrics: %s", exc)
                self.daemon.shutdown(f"cannot serve metrics: {exc}")
                return
        if self._initial_trace is not None:
            try:
                self.start_trace(self._initial_trace)
            except TraceError as exc:
                log.error("cannot trace: %s", exc)
                self.daemon.shutdown(f"cannot trace: {exc}")

    def close(self) -> None:
        self.stop_trace()
        if self.metrics is not None:
            self.metrics.close()

    def status(self) -> dict[str, Any]:
        """Where the metrics are served and written, and the trace file (for ``commd status``)."""
        metrics = self.metrics
        return {
            "metrics_url": (f"http://{metrics.settings.addr}:{metrics.port}/metrics"
                            if metrics is not None and metrics.port is not None else None),
            "metrics_textfile": metrics.settings.textfile if metrics is not None else None,
            "trace": self.daemon.tracer.path,
        }

    # ---- trace ---------------------------------------------------------------------
    def start_trace(self, path: str) -> str:
        """Trace from now on into this node's file for ``path``; returns that file."""
        if self.daemon.tracer.on:
            raise TraceError(f"a trace is already being written to {self.daemon.tracer.path}")
        node, name = self._node()
        target = node_trace_path(check_trace_path(path, "trace path"), node)
        self.daemon.tracer = Tracer(target, node or 0, name)
        log.info("tracing every op to %s", target)
        return target

    def stop_trace(self) -> str | None:
        """Finish the trace (valid JSON from then on); returns its file (None: none was on)."""
        tracer = self.daemon.tracer
        if not tracer.on:
            return None
        self.daemon.tracer = NullTrace()
        tracer.close()
        return tracer.path

    def on_control(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A ``trace`` control message (from ``commd trace``): apply here, forward to the fabric."""
        action = msg.get("action")
        if action not in TRACE_ACTIONS:
            raise TraceError(f"field 'action' must be one of {list(TRACE_ACTIONS)}, got {action!r}")
        path = msg.get("path")
        if action == "start":
            path = check_trace_path(path, "field 'path'")
        written = self.apply({"action": action, "path": path})
        fabric_member = self.daemon.fabric_member
        forwarded = fabric_member.forward_trace(action, path) if fabric_member is not None else 0
        return {"file": written, "forwarded_to": forwarded}

    def apply(self, item: dict[str, Any]) -> str | None:
        if item["action"] not in TRACE_ACTIONS:
            raise TraceError(f"unknown trace action {item['action']!r}")
        if item["action"] == "start":
            return self.start_trace(item["path"])
        return self.stop_trace()

    def apply_forwarded(self, action: str, path: str | None) -> None:
        """A start/stop forwarded by the coordinator: failures are logged (the CLI saw node 0's answer)."""
        try:
            self.apply({"action": action, "path": path})
        except (TraceError, KeyError) as exc:
            log.error("trace %s forwarded by the coordinator failed: %s", action, exc)
