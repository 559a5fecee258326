"""Ops that wait too long for their ranks: warn once each, and say when to shut down.

One inspector serves both places that look for stalls: the node (ops its own ranks
have partly submitted) and the fabric's coordinator (ops some nodes have not reported,
rows that also name the missing nodes).  Rows are the dicts of
``LocalScheduler.waiting_summary`` / ``Coordinator.stalls``: group, seq, kind,
waiting_s, missing_ranks (and missing_nodes).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any


class StallInspector:
    def __init__(self, warning_s: float, shutdown_s: float, logger: logging.Logger, name_nodes: bool = False) -> None:
        """``shutdown_s``: 0 never shuts down.  ``name_nodes``: rows name the missing nodes too."""
        self.warning_s = warning_s
        self.shutdown_s = shutdown_s
        self._log = logger
        self._name_nodes = name_nodes
        self._warned: set[tuple[str, int]] = set()

    def inspect(self, rows: Iterable[dict[str, Any]], may_shut_down: bool = True) -> str | None:
        """Warn once per (group, seq) for each stalled row; the shutdown reason if one stalled too long."""
        for row in rows:
            if row["waiting_s"] < self.warning_s or row["seq"] is None:
                continue
            key = (row["group"], row["seq"])
            if key not in self._warned:
                self._warned.add(key)
                self._warn(row)
            if may_shut_down and self.shutdown_s and row["waiting_s"] >= self.shutdown_s:
                return (f"{row['kind']} #{row['seq']} on group '{row['group']}' stalled for "
                        f"{row['waiting_s']:.0f}s waiting for ranks {row['missing_ranks']}")
        return None

    def _warn(self, row: dict[str, Any]) -> None:
        if self._name_nodes:
            self._log.warning("stalled: %s #%s on group '%s' has waited %.0fs for ranks %s (nodes %s)",
                              row["kind"], row["seq"], row["group"], row["waiting_s"], row["missing_ranks"],
                              row["missing_nodes"])
        else:
            self._log.warning("stalled: %s #%s on group '%s' has waited %.0fs for ranks %s to submit it",
                              row["kind"], row["seq"], row["group"], row["waiting_s"], row["missing_ranks"])
