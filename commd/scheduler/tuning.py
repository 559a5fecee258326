"""The tuning table: which lane and which algorithm win, per op, message size and group-size class.

``commd tune`` measures every lane of a fabric and writes one table; node 0's
daemon loads it at start, checks that it was measured on a fabric like its
own (same node count, same lanes) and hands it to the coordinator, which
consults it between the config rules and the default lane.  The coordinator
makes every lane decision of the fabric, so one table decides identically
for every node; members get a copy in the fabric's config for ``commd
status`` and ``commd tune --show``.

A table is JSON: a format tag and version, when and on what fabric it was
measured, and one entry per (op kind, group-size class, measured size) with
the winner and every lane's figures kept beside it.  Each entry covers the
sizes from halfway (geometrically) to its lower neighbour up to halfway to
its upper neighbour; the first and last entries extend to 0 and infinity.

Since version 2 an entry also names the algorithm that won among the tcp
lane's candidates (its native algorithm, ``"native"``, and each program the
sweep ran with an ``algo=`` hint); the tcp lane competes with the others at
its best candidate's time.  The algorithm is kept even where another lane
wins, since a rule may still send the op to the tcp lane.  A version 1 table
(lanes only) still loads: its entries name no algorithm.

Since version 3 an entry may also carry the tcp lane's compressed paths (``commd tune
--compression``: one ``commd-tcp+CODEC`` row per codec): each codec's figures, the best
lossless codec and the best codec of all, each only where it beats the plain tcp path by the
switch margin.  The coordinator compresses an op that lets it choose with the lossless one, or
with the best of all where the op allowed lossy codecs.  Tables of versions 1 and 2 name no
codec: nothing is compressed by the table.

All-to-alls have two kinds of cells: ``alltoall`` (every rank sends every rank one block size,
as ``commd bench --ops alltoall`` measures them) and ``alltoallv`` (blocks of unequal sizes and
different bytes per rank, ``commd bench --ops alltoallv``).  The coordinator looks an all-to-all
up as its uneven variant (``UNEVEN_VARIANT``) when the bytes its nodes send each other differ:
such an op moves its bytes differently (no program can run it, the largest sender sets its
time), so the even cells' winner need not be its.  A table without ``alltoallv`` cells for the
op's group class (measured before they existed, or with ``--ops`` leaving them out) decides it
by the ``alltoall`` cells, as before; the entries' shape is the same, so the version is too.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TABLE_FORMAT = "commd-tuning"
TABLE_VERSION = 3
#: Versions this commd reads (1: lanes only, no algorithm per entry; 2: no codecs per entry).
READABLE_VERSIONS = (1, 2, 3)
#: The tcp lane's own algorithm, as entries and measurements name it.
NATIVE = "native"
#: The lane programs run on, and the op kinds they run.
PROGRAM_LANE = "tcp"
PROGRAM_KINDS = ("allreduce", "alltoall")

#: The op kinds a sweep measures; every other kind is looked up as the one that shares its lane primitive.
TUNED_KINDS = ("allreduce", "broadcast", "allgather", "alltoall", "alltoallv", "sendrecv")
_AS_TUNED = {
    "allreduce": "allreduce", "reduce": "allreduce", "reduce_scatter": "allreduce",
    "broadcast": "broadcast",
    "allgather": "allgather",
    "alltoall": "alltoall", "gather": "alltoall", "scatter": "alltoall",
    "alltoallv": "alltoallv",
    "send": "sendrecv", "recv": "sendrecv", "sendrecv": "sendrecv",
}
#: Per op kind, the tuned kind its ops are looked up as when their node-to-node blocks differ
#: (an all-to-all of unequal blocks: the coordinator's test that keeps programs off it).
UNEVEN_VARIANT = {"alltoall": "alltoallv"}
#: A variant's cells, where a table has none for the op's group class: its kind's (an older table).
_VARIANT_OF = {variant: kind for kind, variant in UNEVEN_VARIANT.items()}
_LANES = ("tcp", "gloo", "mpi", "nccl")
#: Near ties go to the earlier lane (commd's own transport first: no extra library in the path).
LANE_PREFERENCE = _LANES
#: Another lane must be this much faster (relative median) to take a cell from a preferred one.
SWITCH_MARGIN = 0.03
_MAX_BYTES = 1 << 62


def tuned_kind(kind: str) -> str | None:
    """The measured kind an op kind is decided by (None: not tuned, e.g. barrier)."""
    return _AS_TUNED.get(kind)


def group_class(nnodes: int) -> str:
    """Group sizes (in nodes) that share entries: 1, 2, 3-4, 5-8, ... (lane costs grow with log n)."""
    if nnodes <= 2:
        return str(max(nnodes, 1))
    high = 1 << math.ceil(math.log2(nnodes))
    return f"{high // 2 + 1}-{high}"


def default_table_dir() -> Path:
    """$COMMD_TUNING_DIR, else $XDG_CACHE_HOME/commd/tuning, else ~/.cache/commd/tuning."""
    explicit = os.environ.get("COMMD_TUNING_DIR")
    if explicit:
        return Path(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "commd" / "tuning"


def default_table_path(node0_name: str, nnodes: int) -> Path:
    """One table per job shape and host: named after node 0 and the node count."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in node0_name) or "node"
    return default_table_dir() / f"{safe}-{nnodes}nodes.json"


@dataclass(frozen=True)
class TuningEntry:
    """Sizes [min_bytes, max_bytes] of ``kind`` on groups of class ``nodes`` → ``lane``, and the tcp
    lane's best ``algorithm`` (None: no program was measured here; ``NATIVE``: the lane's own won);
    ``codecs``: the tcp lane's compressed paths' figures per codec, ``codec_lossless`` / ``codec_any``
    the best lossless codec / the best codec of all where it beats the plain tcp path (else None)."""

    kind: str
    nodes: str
    min_bytes: int
    max_bytes: int
    size: int  # the measured size
    lane: str
    measured: dict[str, dict[str, float]] = field(default_factory=dict)  # lane or "tcp/ALGO" -> figures
    algorithm: str | None = None
    codecs: dict[str, dict[str, float]] = field(default_factory=dict)
    codec_lossless: str | None = None
    codec_any: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"kind": self.kind, "nodes": self.nodes, "min_bytes": self.min_bytes, "max_bytes": self.max_bytes,
               "size": self.size, "lane": self.lane, "algorithm": self.algorithm, "measured": self.measured}
        if self.codecs:  # (an entry without compressed paths keeps its version 2 form and digest)
            out.update(codecs=self.codecs, codec_lossless=self.codec_lossless, codec_any=self.codec_any)
        return out

    def codec_choices(self, lossy: bool) -> list[str]:
        """The codecs to try for an op in this entry, best first: the best of all where ``lossy`` is
        allowed, then the best lossless one (the op's dtype may rule the first out)."""
        found = [self.codec_any] if lossy else []
        found.append(self.codec_lossless)
        return [name for name in dict.fromkeys(found) if name is not None]

    def lane_without_programs(self, margin: float = SWITCH_MARGIN) -> str:
        """The winning lane had no program run: the lanes' own figures (the tcp lane's native row)."""
        lanes = {name: figs for name, figs in self.measured.items() if "/" not in name}
        native = self.measured.get(f"{PROGRAM_LANE}/{NATIVE}")
        if native is not None:
            lanes[PROGRAM_LANE] = native
        known = [name for name in LANE_PREFERENCE if name in lanes and "median_us" in lanes[name]]
        return _preferred(known, lanes, margin) if known else self.lane

    @property
    def winner(self) -> str:
        """The cell's winner as bench paths name it: the lane, with ``/ALGO`` when a program wins on tcp."""
        if self.lane == PROGRAM_LANE and self.algorithm not in (None, NATIVE):
            return f"{self.lane}/{self.algorithm}"
        return self.lane


@dataclass
class TuningTable:
    fabric: dict[str, Any]
    entries: list[TuningEntry]
    created: str = ""
    table_id: str = ""
    source: str = ""  # where it was loaded from (not saved)
    _index: dict[tuple[str, str], list[TuningEntry]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._index = {}
        for entry in sorted(self.entries, key=lambda e: e.min_bytes):
            self._index.setdefault((entry.kind, entry.nodes), []).append(entry)
        if not self.table_id:
            payload = json.dumps([e.to_json() for e in self.entries], sort_keys=True).encode()
            self.table_id = _digest(payload)

    # ---- decisions -----------------------------------------------------------
    def lookup(self, kind: str, nbytes: int, group_nodes: int) -> str | None:
        """The measured winning lane for this op, or None where the table has no entry.

        ``kind`` is an op kind or an uneven variant (``alltoallv``).  A kind no program can run
        (reduce, reduce-scatter, gather, scatter, alltoallv) gets the winner among the lanes' own
        algorithms: the tcp lane may have won its cell only by a program (an alltoallv decided
        by the alltoall cells of an older table)."""
        entry = self.entry_for(kind, nbytes, group_nodes)
        if entry is None:
            return None
        if kind in PROGRAM_KINDS or entry.algorithm in (None, NATIVE):
            return entry.lane
        return entry.lane_without_programs()

    def lookup_algorithm(self, kind: str, nbytes: int, group_nodes: int) -> str | None:
        """The tcp lane's measured best algorithm for this op (``NATIVE`` or a program's name), or None
        where the table has no entry or measured no program for it, or no program runs this kind."""
        if kind not in PROGRAM_KINDS:
            return None
        entry = self.entry_for(kind, nbytes, group_nodes)
        return entry.algorithm if entry is not None else None

    def lookup_codecs(self, kind: str, nbytes: int, group_nodes: int, lossy: bool) -> list[str]:
        """The measured codecs for this op, best first (``TuningEntry.codec_choices``); [] where the
        table has no entry, measured no codec here, or no codec beat the plain tcp path."""
        entry = self.entry_for(kind, nbytes, group_nodes)
        return entry.codec_choices(lossy) if entry is not None else []

    def entry_for(self, kind: str, nbytes: int, group_nodes: int) -> TuningEntry | None:
        """The entry whose size range holds ``nbytes`` for this op's measured kind and group class
        (an uneven variant without cells of that class: its kind's)."""
        measured = _AS_TUNED.get(kind)
        if measured is None:
            return None
        cells = self._index.get((measured, group_class(group_nodes)))
        if cells is None and measured in _VARIANT_OF:
            cells = self._index.get((_VARIANT_OF[measured], group_class(group_nodes)))
        for entry in cells or ():
            if entry.min_bytes <= nbytes <= entry.max_bytes:
                return entry
        return None

    def check_fabric(self, nnodes: int, lanes: list[str] | tuple[str, ...]) -> str | None:
        """Why this table does not fit a fabric of ``nnodes`` nodes with ``lanes`` (None: it fits)."""
        want_nodes = self.fabric.get("nodes")
        if want_nodes != nnodes:
            return f"it was measured on {want_nodes} nodes, this fabric has {nnodes}"
        want_lanes = sorted(self.fabric.get("lanes", []))
        if want_lanes != sorted(lanes):
            return f"it was measured with lanes {want_lanes}, this fabric has {sorted(lanes)}"
        return None

    def describe(self) -> str:
        return (f"tuning table {self.table_id} ({len(self.entries)} entries, {self.fabric.get('nodes')} nodes, "
                f"lanes {','.join(self.fabric.get('lanes', []))}, measured {self.created})")

    # ---- building ------------------------------------------------------------
    @classmethod
    def from_measurements(cls, fabric: dict[str, Any], rows: list[dict[str, Any]],
                          margin: float = SWITCH_MARGIN) -> TuningTable:
        """Pick the lane with the lowest median per (kind, group nodes, size); keep every lane's figures.

        A lane earlier in ``LANE_PREFERENCE`` keeps the cell unless another is faster by more than
        ``margin`` (relative): on a noisy machine a near tie would otherwise flip the winner from
        one size to the next, and a lane within the margin costs at most that much.

        A row with an ``algorithm`` (a tcp lane row run with that program; ``NATIVE`` is the plain
        tcp row) is a tcp candidate: the best candidate (the native one keeps near ties, then the
        order the programs were measured in) becomes the entry's algorithm, and the tcp lane
        competes with the other lanes at that candidate's time.

        A row with a ``codec`` (a ``commd.codecs`` name: the tcp lane's compressed path) is kept in
        the entry's ``codecs``; the best lossless codec and the best codec of all become the entry's
        ``codec_lossless`` / ``codec_any`` where they beat the plain tcp row by more than ``margin``
        (the plain path keeps near ties; no plain tcp row in the cell: no choice).  Codecs do not
        take part in the lane choice.
        """
        cells: dict[tuple[str, str], dict[int, dict[str, dict[str, float]]]] = {}
        programs: dict[tuple[str, str], dict[int, dict[str, dict[str, float]]]] = {}
        coded: dict[tuple[str, str], dict[int, dict[str, dict[str, float]]]] = {}
        for i, row in enumerate(rows):
            where = f"measurement {i}"
            kind = row.get("kind")
            if kind not in TUNED_KINDS:
                raise ValueError(f"{where}: kind {kind!r} is not one of {list(TUNED_KINDS)}")
            lane = row.get("lane")
            if lane not in _LANES:
                raise ValueError(f"{where}: lane {lane!r} is not one of {list(_LANES)}")
            nodes, size = _positive_int(row, "nodes", where), _positive_int(row, "bytes", where)
            figures = {k: float(row[k]) for k in ("median_us", "p95_us", "busbw_gbs") if k in row}
            if "median_us" not in figures or not figures["median_us"] > 0:
                raise ValueError(f"{where}: 'median_us' must be a positive number")
            algorithm = row.get("algorithm")
            if algorithm is not None and (lane != PROGRAM_LANE or not _is_name(algorithm)):
                raise ValueError(f"{where}: 'algorithm' {algorithm!r} must be a program's name on the tcp lane")
            codec = row.get("codec")
            if codec is not None and (lane != PROGRAM_LANE or algorithm is not None or not _is_codec(codec)):
                raise ValueError(f"{where}: 'codec' {codec!r} must be a codec's name (commd.codecs) on the tcp "
                                 "lane, without an algorithm")
            cell = (kind, group_class(nodes))
            if codec is not None:
                coded.setdefault(cell, {}).setdefault(size, {})[codec] = figures
            elif algorithm is None:
                cells.setdefault(cell, {}).setdefault(size, {})[lane] = figures
            else:
                programs.setdefault(cell, {}).setdefault(size, {})[algorithm] = figures
            cells.setdefault(cell, {}).setdefault(size, {})
        entries = []
        for (kind, nodes), by_size in sorted(cells.items()):
            sizes = sorted(by_size)
            for i, size in enumerate(sizes):
                low = 0 if i == 0 else math.isqrt(sizes[i - 1] * size) + 1
                high = _MAX_BYTES if i == len(sizes) - 1 else math.isqrt(size * sizes[i + 1])
                lanes = dict(by_size[size])
                candidates = dict(programs.get((kind, nodes), {}).get(size, {}))
                algorithm = None
                if candidates:
                    if PROGRAM_LANE in lanes:  # the plain tcp row is the native algorithm
                        candidates = {NATIVE: lanes[PROGRAM_LANE], **candidates}
                    order = sorted(candidates, key=lambda name: name != NATIVE)  # (stable: measuring order)
                    algorithm = _preferred(order, candidates, margin)
                    lanes[PROGRAM_LANE] = candidates[algorithm]
                if not lanes:
                    raise ValueError(f"{kind} of {size} bytes on {nodes} node(s): compressed rows only, no lane's "
                                     "plain row to compare them with")
                lane = _preferred(sorted(lanes, key=LANE_PREFERENCE.index), lanes, margin)
                measured = dict(by_size[size])
                measured.update({f"{PROGRAM_LANE}/{name}": figs for name, figs in candidates.items()
                                 if name != NATIVE or figs is not measured.get(PROGRAM_LANE)})
                codecs = dict(coded.get((kind, nodes), {}).get(size, {}))
                plain = by_size[size].get(PROGRAM_LANE)
                lossless, best = (_best_codec(codecs, plain, margin, lossy) for lossy in (False, True))
                entries.append(TuningEntry(kind, nodes, low, high, size, lane, measured, algorithm, codecs,
                                           lossless, best))
        return cls(dict(fabric), entries, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))

    # ---- files -----------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        # (a table without codec figures is written as version 2: a commd from before codecs reads it)
        version = TABLE_VERSION if any(e.codecs for e in self.entries) else 2
        return {"format": TABLE_FORMAT, "version": version, "id": self.table_id, "created": self.created,
                "fabric": self.fabric, "entries": [e.to_json() for e in self.entries]}

    def save(self, path: Path) -> None:
        """Write atomically: a daemon starting meanwhile reads the old table or the new one."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        os.replace(tmp, path)

    @classmethod
    def from_json(cls, raw: Any, where: str = "tuning table") -> TuningTable:
        """Validate a table's JSON; errors name the field."""
        if not isinstance(raw, dict) or raw.get("format") != TABLE_FORMAT:
            raise ValueError(f"{where}: not a commd tuning table (missing \"format\": \"{TABLE_FORMAT}\")")
        if raw.get("version") not in READABLE_VERSIONS:
            raise ValueError(f"{where}: table format version {raw.get('version')!r} is not supported "
                             f"(this commd reads versions {', '.join(map(str, READABLE_VERSIONS))}; "
                             "run `commd tune` again)")
        fabric = raw.get("fabric")
        if not isinstance(fabric, dict) or not isinstance(fabric.get("nodes"), int) or fabric["nodes"] < 1:
            raise ValueError(f"{where}: 'fabric' must be an object with a positive integer 'nodes'")
        lanes = fabric.get("lanes")
        if not isinstance(lanes, list) or not all(lane in _LANES for lane in lanes):
            raise ValueError(f"{where}: fabric 'lanes' must be a list of {list(_LANES)}, got {lanes!r}")
        raw_entries = raw.get("entries")
        if not isinstance(raw_entries, list):
            raise ValueError(f"{where}: 'entries' must be a list")
        entries = []
        for i, item in enumerate(raw_entries):
            at = f"{where} entries[{i}]"
            if not isinstance(item, dict):
                raise ValueError(f"{at}: must be an object")
            if item.get("kind") not in TUNED_KINDS:
                raise ValueError(f"{at}: 'kind' must be one of {list(TUNED_KINDS)}, got {item.get('kind')!r}")
            if item.get("lane") not in lanes:
                raise ValueError(f"{at}: 'lane' {item.get('lane')!r} is not one of the table's lanes {lanes}")
            if not isinstance(item.get("nodes"), str):
                raise ValueError(f"{at}: 'nodes' must be a group-size class such as \"2\" or \"3-4\"")
            low, high, size = (_nonneg_int(item, k, at) for k in ("min_bytes", "max_bytes", "size"))
            if low > high:
                raise ValueError(f"{at}: empty size range [{low}, {high}]")
            measured = item.get("measured", {})
            if not isinstance(measured, dict):
                raise ValueError(f"{at}: 'measured' must be an object")
            algorithm = item.get("algorithm")
            if algorithm is not None and not _is_name(algorithm):
                raise ValueError(f"{at}: 'algorithm' must be a program's name (or null), got {algorithm!r}")
            codecs, lossless, best = _codec_fields(item, at)
            entries.append(TuningEntry(item["kind"], item["nodes"], low, high, size, item["lane"], measured,
                                       algorithm, codecs, lossless, best))
        return cls(fabric, entries, created=str(raw.get("created", "")), table_id=str(raw.get("id", "")))

    @classmethod
    def load(cls, path: Path) -> TuningTable:
        try:
            raw = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ValueError(f"cannot read tuning table {path}: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"tuning table {path} is not valid JSON: {exc}") from None
        table = cls.from_json(raw, f"tuning table {path}")
        table.source = str(path)
        return table

    # ---- showing -----------------------------------------------------------------
    def grid(self) -> str:
        """Sizes down, op kinds across, the winning lane in each cell (per group-size class)."""
        lines = [self.describe()]
        for nodes in sorted({e.nodes for e in self.entries}, key=_class_order):
            kinds = [k for k in TUNED_KINDS if (k, nodes) in self._index]
            sizes = sorted({e.size for e in self.entries if e.nodes == nodes})
            lines.append("")
            lines.append(f"groups of {nodes} node(s): winner per size, lane/algorithm where a program wins on "
                         "tcp (median time of each candidate in the table file)")
            width = max([10] + [len(e.winner) for e in self.entries if e.nodes == nodes])
            lines.append(f"{'size':>10}  " + "  ".join(f"{k:>{width}}" for k in kinds))
            for size in sizes:
                cells = []
                for kind in kinds:
                    entry = next((e for e in self._index[(kind, nodes)] if e.size == size), None)
                    cells.append(f"{entry.winner if entry else '-':>{width}}")
                lines.append(f"{format_bytes(size):>10}  " + "  ".join(cells))
            changes = self.winner_changes(nodes)
            if changes:
                lines.append("winner changes: " + "; ".join(changes))
            lines.extend(self.codec_lines(nodes))
        return "\n".join(lines)

    def codec_lines(self, nodes: str) -> list[str]:
        """Per kind measured with codecs, the codec chosen per size: lossless (ops that let the
        daemons choose) / of all (ops that allowed lossy codecs); '-' where none beat plain tcp."""
        out = []
        for kind in TUNED_KINDS:
            measured = [e for e in self._index.get((kind, nodes), ()) if e.codecs]
            if measured:
                cells = [f"{format_bytes(e.size)} {e.codec_lossless or '-'}/{e.codec_any or '-'}" for e in measured]
                out.append(f"{kind} codec (lossless/any): " + ", ".join(cells))
        return out

    def winner_changes(self, nodes: str) -> list[str]:
        """Where, per kind, the winning lane changes as sizes grow."""
        out = []
        for kind in TUNED_KINDS:
            previous = None
            for entry in self._index.get((kind, nodes), ()):
                if previous is not None and entry.winner != previous.winner:
                    out.append(f"{kind} {previous.winner}->{entry.winner} at {format_bytes(entry.size)}")
                previous = entry
        return out


def format_bytes(n: int, compact: bool = False) -> str:
    """Whole binary units: '4 KiB' (compact: '4K', as size options are written), else bytes."""
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}" if compact else f"{n >> shift} {unit}iB"
    return f"{n}" if compact else f"{n} B"


def _preferred(order: list[str], figures: dict[str, dict[str, float]], margin: float) -> str:
    """The first of ``order`` within ``margin`` (relative) of the fastest median."""
    fastest = min(figures[name]["median_us"] for name in order)
    return next(name for name in order if figures[name]["median_us"] <= fastest * (1 + margin))


def _is_codec(value: Any) -> bool:
    """Whether ``value`` names a codec (``commd.codecs``; a table names no per-hop baseline)."""
    from commd.codecs import CODECS

    return any(value == codec.name for codec in CODECS)


def _lossy(name: str) -> bool:
    from commd.codecs import get

    return get(name).lossy


def _best_codec(codecs: dict[str, dict[str, float]], plain: dict[str, float] | None, margin: float,
                lossy: bool) -> str | None:
    """The fastest codec (lossless ones only unless ``lossy``) if it beats the plain tcp path by more
    than ``margin``; None otherwise, or without a plain tcp figure to compare with."""
    names = [name for name in codecs if lossy or not _lossy(name)]
    if plain is None or "median_us" not in plain or not names:
        return None
    figures = {"": plain, **{name: codecs[name] for name in names}}
    best = _preferred(["", *names], figures, margin)  # (the plain path first: it keeps near ties)
    return best or None


def _codec_fields(item: dict[str, Any], at: str) -> tuple[dict[str, dict[str, float]], str | None, str | None]:
    """An entry's ``codecs`` (name → figures with a positive ``median_us``), ``codec_lossless`` (a
    lossless codec measured there) and ``codec_any`` (a codec measured there); absent: none."""
    codecs = item.get("codecs", {})
    if not isinstance(codecs, dict):
        raise ValueError(f"{at}: 'codecs' must be an object (codec name -> figures)")
    for name, figures in codecs.items():
        if not _is_codec(name):
            raise ValueError(f"{at}: 'codecs' names {name!r}, which is not a codec")
        median = figures.get("median_us") if isinstance(figures, dict) else None
        if isinstance(median, bool) or not isinstance(median, int | float) or not median > 0:
            raise ValueError(f"{at}: 'codecs' {name!r} must hold a positive 'median_us'")
    chosen = []
    for key in ("codec_lossless", "codec_any"):
        name = item.get(key)
        if name is not None and name not in codecs:
            raise ValueError(f"{at}: {key!r} must be null or one of the entry's measured codecs "
                             f"{sorted(codecs)}, got {name!r}")
        chosen.append(name)
    if chosen[0] is not None and _lossy(chosen[0]):
        raise ValueError(f"{at}: 'codec_lossless' names {chosen[0]!r}, which is lossy")
    return codecs, chosen[0], chosen[1]


def _is_name(value: Any) -> bool:
    """An algorithm's name as tables store it: a non-empty string of at most 255 characters."""
    return isinstance(value, str) and 0 < len(value) <= 255


def _digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()[:12]


def _class_order(nodes: str) -> int:
    return int(nodes.split("-")[0])


def _positive_int(row: dict[str, Any], key: str, where: str) -> int:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: '{key}' must be a positive integer, got {value!r}")
    return value


def _nonneg_int(row: dict[str, Any], key: str, where: str) -> int:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: '{key}' must be a non-negative integer, got {value!r}")
    return value
