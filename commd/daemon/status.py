"""The status document: what ``commd status`` prints and the Prometheus metrics read."""

from __future__ import annotations

import os
import time
from typing import Any

from commd.daemon.clients import ClientRegistry
from commd.daemon.config import DaemonConfig
from commd.daemon.registered import RegisteredSegments
from commd.daemon.state import NodeState
from commd.execution import torch_loader
from commd.observe import gcpauses
from commd.observe.hooks import DaemonObservers
from commd.observe.stats import Stats
from commd.scheduler.local import LocalScheduler


def status_document(config: DaemonConfig, state: NodeState, stats: Stats, scheduler: LocalScheduler,
                    clients: ClientRegistry, observers: DaemonObservers) -> dict[str, Any]:
    """Every figure of the node, read on its event loop (the only thread that changes them)."""
    waiting = scheduler.waiting_summary()
    waiting_by_group: dict[str, int] = {}
    for row in waiting:
        waiting_by_group[row["group"]] = waiting_by_group.get(row["group"], 0) + 1
    member = state.member
    return {
        "job": config.paths.job,
        "pid": os.getpid(),
        "uptime_s": round(time.time() - stats.started_at, 3),
        "closing": state.closing,
        "torch_loaded": torch_loader.loaded(),
        "gc": gcpauses.PAUSES.status(),
        "clients": [
            {"rank": c.rank, "local_rank": c.local_rank, "pid": c.pid, "arena_bytes": c.arena_bytes,
             "pending_ops": len(c.pending.ops), "pending_bytes": c.pending.bytes,
             **RegisteredSegments.client_status(c)}
            for c in sorted(clients, key=lambda c: c.rank)
        ],
        "bytes_by_path": dict(stats.bytes_by_path),
        "op_batches": {"batches": stats.op_batches, "ops": stats.batched_ops},
        "max_registered_bytes": config.max_registered_bytes,
        "groups": {
            name: {
                "size": g.size,
                "next_seq": g.next_seq,
                "waiting": waiting_by_group.get(name, 0),
                "queued": g.queued,
                "executing": g.executing,
                "done": g.done,
                "failed": g.failed,
                "bytes": g.bytes,
            }
            for name, g in stats.groups.items()
        },
        "ops_done": stats.ops_done,
        "bytes_moved": stats.bytes_moved,
        "latency_us": stats.latency_table(),
        "ops_by_lane": stats.per_kind(),
        "mix": stats.mix_rows(),
        "oldest_waiting": waiting[0] if waiting else None,
        "stalls": _stalls(config, state, waiting),
        "node": config.node_name,
        "fabric": member.status() if member is not None else None,
        "last_errors": list(stats.errors),
        "departures": list(stats.departures),
        "membership": {"epoch": stats.membership_epoch,
                       "gone_ranks": {str(rank): info for rank, info in sorted(stats.gone_ranks.items())},
                       **stats.ft_status()},
        "limits": config.limits.to_status(),
        "limits_hit": dict(stats.limits_hit),
        "observe": observers.status(),
    }


def _stalls(config: DaemonConfig, state: NodeState, waiting: list[dict[str, Any]]) -> list[dict[str, Any]]:
    threshold = config.scheduler.stall_warning_s
    rows = [dict(r, missing_nodes=[]) for r in waiting if r["waiting_s"] >= threshold]
    if state.member is not None:
        rows += [r for r in state.member.fabric_stalls]
    return rows
