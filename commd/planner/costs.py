"""What a collective costs on each mesh dimension: t = α + β·bytes, fitted to measured medians.

Between nodes the figures come from ``commd tune``'s table: per op kind and group-size class, each
entry's winning lane's median at its measured size (the lane the daemons will pick there).  Groups
inside one node come from ``commd plan calibrate`` (the same collectives among this node's ranks),
or from a costs file.  No constant comes from elsewhere: a kind without a measurement is priced
from its dual only where the algorithms make them equal (a ring reduce-scatter moves what a ring
all-gather of the same whole tensor moves) and otherwise is an error naming what to measure.

A costs file (``--costs``, and what ``calibrate`` writes)::

    {"format": "commd-costs", "version": 1, "groups": {"1x2": {"allreduce": [[bytes, seconds], ...], ...}},
     "flops_per_s": 1.2e11}

Group keys are ``NODESxRANKS``: a group of RANKS ranks over NODES nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from commd.planner.files import check_header, read_json
from commd.scheduler.config import DEFAULT_FUSION_THRESHOLD

#: Up to this many bytes, all-reduces released together are fused into one by the daemons (their default).
FUSION_THRESHOLD = DEFAULT_FUSION_THRESHOLD

COSTS_FORMAT = "commd-costs"
COSTS_VERSION = 1
KINDS = ("allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall")
#: Kinds priced by another kind's curve when they were not measured themselves (ring duality).
DUALS = {"reduce_scatter": "allgather"}


class CostError(ValueError):
    """Missing or unusable measurements; the message says what to measure."""


@dataclass(frozen=True)
class AlphaBeta:
    """t(bytes) = alpha + beta * bytes, in seconds."""

    alpha: float
    beta: float
    points: int
    source: str

    def __call__(self, nbytes: int) -> float:
        return self.alpha + self.beta * nbytes if nbytes > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"alpha_s": self.alpha, "beta_s_per_byte": self.beta, "points": self.points, "source": self.source}


def fit(points: list[tuple[int, float]], source: str) -> AlphaBeta:
    """Least squares with alpha, beta >= 0 over (bytes, seconds) points, weighted relatively (each
    point's error counts in proportion to its time, so small messages are not drowned by large)."""
    from scipy.optimize import nnls

    usable = [(b, t) for b, t in points if b > 0 and t > 0]
    if not usable:
        raise CostError(f"{source}: no measurement to fit")
    if len(usable) == 1:
        b, t = usable[0]
        return AlphaBeta(0.0, t / b, 1, source)
    a = np.array([[1.0 / t, b / t] for b, t in usable])
    alpha, beta = nnls(a, np.ones(len(usable)))[0]
    return AlphaBeta(float(alpha), float(beta), len(usable), source)


def group_key(nodes: int, ranks: int) -> str:
    return f"{nodes}x{ranks}"


@dataclass
class CollectiveCosts:
    """Fitted curves per (group key, kind) and the compute rate, when known."""

    curves: dict[tuple[str, str], AlphaBeta]
    flops_per_s: float | None = None
    source: str = ""

    def seconds(self, kind: str, nbytes: int, nodes: int, ranks: int) -> float:
        return self.curve(kind, nodes, ranks)(nbytes)

    def side_by_side(self, kind: str, nbytes: int, nodes: int, ranks: int, groups: int) -> float:
        """One collective on each of ``groups`` groups at once, every group crossing the same nodes' links
        (a 2-D mesh's dp groups): the daemons fuse all-reduces up to ``FUSION_THRESHOLD`` released together
        into one of their summed bytes, and run the others one after another in the fabric's one op
        order.  Measured on 2 simulated hosts x 2 ranks at 1 Gbit/s, the pair of groups took 2.1, 6.6, 12.8,
        21.8 and 81 ms per all-reduce of 2 KiB, 128 KiB, 512 KiB, 1 MiB and 4 MiB between products of
        matrices; summing the bytes priced them 1.7, 4.2, 11.7, 21.6, 81.4; this, 1.7, 5.9, 13.4, 23.3, 83.1."""
        if groups > 1 and not (kind == "allreduce" and nbytes <= FUSION_THRESHOLD):
            return groups * self.seconds(kind, nbytes, nodes, ranks)
        return self.seconds(kind, nbytes * groups, nodes, ranks)

    def curve(self, kind: str, nodes: int, ranks: int) -> AlphaBeta:
        key = group_key(nodes, ranks)
        for name in (kind, DUALS.get(kind)):
            if name is None:
                continue
            found = self.curves.get((key, name)) or (self._by_nodes(name, nodes) if nodes > 1 else None)
            if found is not None:
                return found
        where = ("run `commd plan calibrate` on a node with that many ranks" if nodes == 1 else
                 f"give a tuning table measured with `commd tune --hosts {nodes}`")
        raise CostError(f"no measured cost of {kind} for a group of {ranks} ranks on {nodes} node(s): {where}")

    def _by_nodes(self, kind: str, nodes: int) -> AlphaBeta | None:
        """A table's curve for groups over ``nodes`` nodes, whatever their ranks per node."""
        from commd.scheduler.tuning import group_class

        for (key, name), curve in self.curves.items():
            if name == kind and key.startswith("table:") and key[6:] == group_class(nodes):
                return curve
        return None

    def merged(self, other: CollectiveCosts) -> CollectiveCosts:
        return CollectiveCosts({**self.curves, **other.curves}, other.flops_per_s or self.flops_per_s,
                               ", ".join(x for x in (self.source, other.source) if x))

    def to_json(self) -> dict[str, Any]:
        return {f"{key}/{kind}": curve.to_json() for (key, kind), curve in sorted(self.curves.items())}

    @classmethod
    def from_table(cls, table: Any) -> CollectiveCosts:
        """Curves from a ``TuningTable``: per kind and group class, each entry's winner's median."""
        points: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for entry in table.entries:
            # the tcp lane's own algorithm is measured as "tcp/native" but wins as "tcp"
            figures = (entry.measured.get(entry.winner) or entry.measured.get(entry.lane)
                       or entry.measured.get(f"{entry.lane}/{entry.algorithm or 'native'}") or {})
            median_us = figures.get("median_us")
            if median_us:
                points.setdefault((f"table:{entry.nodes}", entry.kind), []).append((entry.size, median_us / 1e6))
        curves = {key: fit(pts, f"tuning table {table.table_id}, {key[1]} on {key[0][6:]} node(s)")
                  for key, pts in points.items()}
        return cls(curves, None, f"tuning table {table.table_id}")

    @classmethod
    def from_json(cls, raw: Any, where: str = "costs file") -> CollectiveCosts:
        check_header(raw, where, COSTS_FORMAT, COSTS_VERSION, "costs file", CostError)
        groups = raw.get("groups", {})
        if not isinstance(groups, dict):
            raise CostError(f"{where}: 'groups' must be an object")
        curves = {}
        for key, kinds in groups.items():
            parts = key.split("x") if isinstance(key, str) else []
            if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise CostError(f"{where}: group {key!r} is not NODESxRANKS")
            if not isinstance(kinds, dict):
                raise CostError(f"{where}: group {key!r} must map kinds to [bytes, seconds] points")
            for kind, pts in kinds.items():
                if kind not in KINDS:
                    raise CostError(f"{where}: group {key!r}: kind {kind!r} is not one of {', '.join(KINDS)}")
                try:
                    parsed = [(int(b), float(t)) for b, t in pts]
                except (TypeError, ValueError):
                    raise CostError(f"{where}: group {key!r}, {kind}: points must be [bytes, seconds] pairs") from None
                if any(b <= 0 or not t > 0 for b, t in parsed):
                    raise CostError(f"{where}: group {key!r}, {kind}: bytes and seconds must be positive")
                curves[(key, kind)] = fit(parsed, f"{where}, {kind} on {key}")
        rate = raw.get("flops_per_s")
        if rate is not None and not (isinstance(rate, (int, float)) and rate > 0):
            raise CostError(f"{where}: flops_per_s must be a positive number")
        return cls(curves, float(rate) if rate else None, where)

    @classmethod
    def load(cls, path: Path) -> CollectiveCosts:
        return cls.from_json(read_json(path, "costs file", CostError), str(path))
