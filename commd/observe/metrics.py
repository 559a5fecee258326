"""The daemon's Prometheus metrics: an HTTP endpoint and a node_exporter textfile.

Nothing here counts anything: a custom collector reads the daemon's own
counters (``commd.observe.stats.Stats``) and its status map at scrape time,
so ``commd status`` and the metrics are the same numbers.  The snapshot is
taken on the daemon's event loop (the only thread that changes them), so a
scrape never sees a half-updated map; the HTTP server runs on its own thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server, write_to_textfile
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from commd.observe.settings import MetricsSettings
from commd.observe.stats import LATENCY_BUCKETS

log = logging.getLogger("commd.metrics")

#: A scrape waits at most this long for the event loop to take the snapshot.
SNAPSHOT_TIMEOUT_S = 5.0


def snapshot(daemon: Any) -> dict[str, Any]:
    """Everything the metrics show, copied (call on the daemon's loop thread)."""
    stats = daemon.stats
    return {
        "status": daemon.status(),
        "by_op": {key: (t.ops, t.bytes, t.latency_sum, list(t.buckets)) for key, t in stats.by_op.items()},
        "error_replies": dict(stats.error_replies),
        "limits_hit": dict(stats.limits_hit),
    }


class DaemonCollector:
    """Turns a snapshot of the daemon's counters into metric families."""

    def __init__(self, take: Callable[[], dict[str, Any]]) -> None:
        self._take = take

    @staticmethod
    def _buffers(status: dict[str, Any]) -> Iterator[Metric]:
        """Bytes of accepted ops' buffers by how they arrived; registered storages mapped now."""
        by_path = CounterMetricFamily("commd_buffer_bytes", "Bytes of ops' buffers by how they reached the daemon: "
                                      "registered, arena (zero-copy), staged (copied in and out), inline, cuda",
                                      labels=["path"])
        for path, nbytes in (status.get("bytes_by_path") or {}).items():
            by_path.add_metric([path], nbytes)
        yield by_path
        clients = status.get("clients") or []
        yield GaugeMetricFamily("commd_registered_segments", "Registered tensor storages mapped, all ranks",
                                value=sum(c.get("registered_segments", 0) for c in clients))
        yield GaugeMetricFamily("commd_registered_bytes", "Bytes of registered tensor storages mapped, all ranks",
                                value=sum(c.get("registered_bytes", 0) for c in clients))

    def collect(self) -> Iterator[Metric]:
        snap = self._take()
        status = snap["status"]
        yield from self._ops(snap["by_op"])
        info = GaugeMetricFamily("commd_daemon_info", "This daemon's job and node", labels=["job", "node"])
        info.add_metric([str(status.get("job")), str(status.get("node"))], 1)
        yield info
        yield GaugeMetricFamily("commd_uptime_seconds", "Seconds since the daemon started",
                                value=status.get("uptime_s", 0))
        yield GaugeMetricFamily("commd_clients", "Ranks connected to this daemon",
                                value=len(status.get("clients") or []))
        yield from self._groups(status.get("groups") or {})
        membership = status.get("membership") or {}
        yield GaugeMetricFamily("commd_membership_epoch", "Losses of a rank this daemon has seen (each starts a "
                                "membership epoch; commd.ft agrees on the survivors from them)",
                                value=membership.get("epoch", 0))
        yield GaugeMetricFamily("commd_ranks_gone", "Ranks of the job known to have died or left",
                                value=len(membership.get("gone_ranks") or {}))
        yield from self._ft(membership)
        yield GaugeMetricFamily("commd_stalled_ops", "Ops waiting longer than the stall threshold "
                                "(stall_warning_s) for ranks to submit them", value=len(status.get("stalls") or []))
        errors = CounterMetricFamily("commd_error_replies", "Error replies sent to ranks, per error code",
                                     labels=["code"])
        for code, count in sorted(snap["error_replies"].items()):
            errors.add_metric([code], count)
        yield errors
        limits = CounterMetricFamily("commd_limits_hit", "Requests refused because a limit was reached",
                                     labels=["limit"])
        for name, count in sorted(snap["limits_hit"].items()):
            limits.add_metric([name], count)
        yield limits
        yield from self._buffers(status)
        batches = status.get("op_batches") or {}
        yield CounterMetricFamily("commd_op_batches", "Batches of ops submitted together (one message each: "
                                  "coalesced ops, batch_isend_irecv)", value=batches.get("batches", 0))
        yield CounterMetricFamily("commd_batched_ops", "Ops that arrived in batches (also in commd_ops)",
                                  value=batches.get("ops", 0))
        rings = CounterMetricFamily("commd_ring_allreduces", "All-reduces the ranks of a local group ran in its "
                                    "exchange ring, without the daemon (not in commd_ops)", labels=["group"])
        for name, ring in sorted((status.get("rings") or {}).items()):
            rings.add_metric([name], ring.get("ops", 0))
        yield rings
        yield from self._gc(status.get("gc") or {})
        fabric = status.get("fabric")
        if fabric is not None:
            yield from self._fabric(fabric)

    @staticmethod
    def _ft(membership: dict[str, Any]) -> Iterator[Metric]:
        """What commd.ft's guards reported to this daemon: only they know a recovery, its end and length."""
        events = CounterMetricFamily("commd_ft_recoveries", "Membership changes commd.ft carried the job through "
                                     "(this node's ranks reported; one per change, however many ranks reported "
                                     "it), by event: recovered (going on without the lost ranks), joined (a "
                                     "replacement taken back in), gave_up (UnrecoverableError)", labels=["event"])
        for event, count in sorted((membership.get("recovery_counts") or {}).items()):
            events.add_metric([event], count)
        yield events
        last = membership.get("last_recovery_s")
        if last is not None:
            yield GaugeMetricFamily("commd_ft_last_recovery_seconds", "How long the latest recovery (recovered or "
                                    "joined) took, from the failure reaching a rank to its rebuilt group (the slowest "
                                    "reporting rank); absent until the first", value=last)

    @staticmethod
    def _gc(gc_status: dict[str, Any]) -> Iterator[Metric]:
        collections = CounterMetricFamily("commd_gc_collections", "Collections of Python's cyclic garbage "
                                          "collector in the daemon, per generation", labels=["generation"])
        paused = CounterMetricFamily("commd_gc_pause_seconds", "Seconds the daemon spent in its garbage "
                                     "collector (holding the GIL), per generation", labels=["generation"])
        for generation, counts in enumerate(gc_status.get("generations") or []):
            collections.add_metric([str(generation)], counts.get("collections", 0))
            paused.add_metric([str(generation)], counts.get("seconds", 0.0))
        yield collections
        yield paused
        yield GaugeMetricFamily("commd_gc_frozen_objects", "Objects moved out of the collector's reach once "
                                "the daemon was set up (torch's among them)", value=gc_status.get("frozen_objects", 0))

    @staticmethod
    def _ops(by_op: dict[tuple[str, str, str], tuple[int, int, float, list[int]]]) -> Iterator[Metric]:
        labels = ["kind", "lane", "group"]
        ops = CounterMetricFamily("commd_ops", "Ops completed, per op kind, lane and group", labels=labels)
        nbytes = CounterMetricFamily("commd_bytes", "Bytes of completed ops (the op's largest buffer), "
                                     "per op kind, lane and group", labels=labels)
        latency = HistogramMetricFamily("commd_op_latency_seconds", "Time from the first rank's submission "
                                        "to completion, per op kind, lane and group", labels=labels)
        bounds = [f"{b:g}" for b in LATENCY_BUCKETS] + ["+Inf"]
        for (kind, lane, group), (count, size, total, buckets) in sorted(by_op.items()):
            key = [kind, lane, group]
            ops.add_metric(key, count)
            nbytes.add_metric(key, size)
            cumulative, rows = 0, []
            for bound, n in zip(bounds, buckets, strict=True):
                cumulative += n
                rows.append((bound, cumulative))
            latency.add_metric(key, rows, total)
        yield ops
        yield nbytes
        yield latency

    @staticmethod
    def _groups(groups: dict[str, dict[str, Any]]) -> Iterator[Metric]:
        depth = GaugeMetricFamily("commd_queue_depth", "Ops of a group per stage: waiting for ranks to submit, "
                                  "queued for a lane, executing", labels=["group", "stage"])
        failed = CounterMetricFamily("commd_ops_failed", "Ops that failed, per group", labels=["group"])
        for name, g in sorted(groups.items()):
            for stage in ("waiting", "queued", "executing"):
                depth.add_metric([name, stage], g.get(stage, 0))
            failed.add_metric([name], g.get("failed", 0))
        yield depth
        yield failed

    @staticmethod
    def _fabric(fabric: dict[str, Any]) -> Iterator[Metric]:
        up = GaugeMetricFamily("commd_fabric_node_up", "1 while a fabric node is alive as this node sees it",
                               labels=["node", "name"])
        heard = GaugeMetricFamily("commd_fabric_node_heard_seconds", "Seconds since this node last heard "
                                  "from a fabric node", labels=["node", "name"])
        for node in fabric.get("nodes") or []:
            key = [str(node["rank"]), str(node["name"])]
            up.add_metric(key, 1 if node.get("alive") else 0)
            heard.add_metric(key, node.get("heard_s_ago") or 0.0)
        yield up
        yield heard
        yield GaugeMetricFamily("commd_fabric_broken", "1 once this node lost the coordinator",
                                value=0 if fabric.get("broken") is None else 1)
        yield GaugeMetricFamily("commd_fabric_negotiating", "Ops reported to the coordinator and not yet released",
                                value=fabric.get("negotiating", 0))
        reports = CounterMetricFamily("commd_fabric_reports", "Ops reported to the coordinator, by path "
                                      "(full report or the cached fast path)", labels=["path"])
        reported, cached = fabric.get("reported", 0), fabric.get("fast_path", 0)
        reports.add_metric(["full"], reported - cached)
        reports.add_metric(["cached"], cached)
        yield reports
        paths = CounterMetricFamily("commd_fabric_ops", "Collectives across nodes released here, by path: "
                                    "scheduled (on a schedule, no coordinator), negotiated (released by the "
                                    "coordinator), fallback (handed back from a schedule to negotiation)",
                                    labels=["path"])
        for path, count in (fabric.get("paths") or {}).items():
            paths.add_metric([path], count)
        yield paths
        control = CounterMetricFamily("commd_fabric_control_items", "Control items (heartbeats aside) this node "
                                      "exchanged with the coordinator (node 0: with every member), by direction",
                                      labels=["direction"])
        for direction, count in (fabric.get("control_items") or {}).items():
            control.add_metric([direction], count)
        yield control
        schedules = fabric.get("schedules") or {}
        yield CounterMetricFamily("commd_fabric_schedules", "Schedules this node followed (started)",
                                  value=schedules.get("started", 0))
        fusion = fabric.get("fusion") or {}
        yield CounterMetricFamily("commd_fabric_fused_sets", "Fused sets of small all-reduces run",
                                  value=fusion.get("sets", 0))
        yield CounterMetricFamily("commd_fabric_fused_ops", "All-reduces run inside fused sets",
                                  value=fusion.get("ops", 0))
        median = fabric.get("negotiation_us_median")
        if median is not None:
            yield GaugeMetricFamily("commd_fabric_negotiation_median_seconds", "Median time from local match "
                                    "to the coordinator's release (last 4096 ops)", value=median / 1e6)


class DaemonMetrics:
    """The registry, the HTTP endpoint and the textfile export of one daemon."""

    def __init__(self, daemon: Any, settings: MetricsSettings) -> None:
        self.daemon = daemon
        self.settings = settings
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(DaemonCollector(self._snapshot))
        self.port: int | None = None
        self._server: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._task: asyncio.Task | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve /metrics and start the textfile writer (call on the loop thread)."""
        self._loop = loop
        self._loop_thread = threading.get_ident()
        if self.settings.port is not None:
            self._server, _thread = start_http_server(self.settings.port, self.settings.addr, self.registry)
            self.port = int(self._server.server_address[1])
            log.info("metrics on http://%s:%d/metrics", self.settings.addr, self.port)
        if self.settings.textfile is not None:
            self.write_textfile()
            self._task = loop.create_task(self._textfile_loop())
            log.info("metrics written to %s every %gs", self.settings.textfile, self.settings.interval_s)

    def close(self) -> None:
        """Stop serving; write the textfile one last time (call on the loop thread)."""
        if self._task is not None:
            self._task.cancel()
        if self.settings.textfile is not None:
            self.write_textfile()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def write_textfile(self) -> None:
        """Atomically replace the textfile (written beside it, then renamed: what node_exporter expects)."""
        try:
            write_to_textfile(self.settings.textfile, self.registry)
        except OSError as exc:
            log.warning("cannot write the metrics textfile %s: %s", self.settings.textfile, exc)

    async def _textfile_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval_s)
            self.write_textfile()

    def _snapshot(self) -> dict[str, Any]:
        if self._loop is None or threading.get_ident() == self._loop_thread:
            return snapshot(self.daemon)
        result: concurrent.futures.Future = concurrent.futures.Future()

        def take() -> None:
            try:
                result.set_result(snapshot(self.daemon))
            except Exception as exc:  # reaches the scraper as an HTTP 500, and the log
                result.set_exception(exc)

        self._loop.call_soon_threadsafe(take)
        try:
            return result.result(timeout=SNAPSHOT_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise RuntimeError(f"the daemon's event loop did not answer within {SNAPSHOT_TIMEOUT_S:g}s") from None
