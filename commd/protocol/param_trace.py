"""PARAM comms traces: the file format ``commd launch --record`` writes and ``commd replay`` reads.

PARAM's comms benchmark (facebookresearch/param, ``commsTraceReplay.py``) replays per-rank
JSON traces in its "basic" format: one file per rank, a list of entries, each one op
(``comms``: ``all_reduce``, ``all_to_allv``, ``wait``, ...) with its sizes in elements
(``in_msg_size``, ``out_msg_size``, ``in_split``, ``out_split``), its ``dtype``, its process
group (``pg_id``, ``global_ranks``, ``world_size``), its request id (``req``: a non-blocking op
and the ``wait`` that names it share one), its ``root`` or ``src_rank``/``dst_rank``, its
``markers`` and ``startTime_ns``.  A file here is one such list, so PARAM can replay it; commd
adds keys PARAM ignores: ``reduce_op``, ``duration_ns`` (how long the call or the wait took,
which is what a replay compares) and ``step`` (the optimizer steps before the entry).
``init`` entries at the head of a file name the process groups the rank knew.

Files are named ``rank<R>.json`` (R the job's global rank); ``<R>.json`` is read too.  Every
field of every entry is validated on load; a bad one raises :class:`TraceError` naming the file,
the entry and the field.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The op names this format uses (PARAM's names), and what each carries.
COLLECTIVES = ("all_reduce", "reduce", "all_to_allv", "all_to_all", "all_gather", "all_gather_base",
               "reduce_scatter", "reduce_scatter_base", "broadcast", "gather", "scatter", "barrier")
POINT_TO_POINT = ("send", "recv")
COMMS = (*COLLECTIVES, *POINT_TO_POINT, "wait", "init")
#: Ops with no tensor sizes of their own.
SIZELESS = ("wait", "barrier", "init")
#: Ops that name a root rank (a global rank).
ROOTED = ("reduce", "broadcast", "gather", "scatter")
#: PARAM's dtype names and the torch / NumPy dtype each stands for.
DTYPES = {"float": "float32", "double": "float64", "half": "float16", "bfloat16": "bfloat16", "int": "int32",
          "long": "int64", "byte": "uint8", "char": "int8", "bool": "bool", "short": "int16"}
REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")
#: Bounds that keep a hostile file from asking for absurd buffers or lists.
MAX_ELEMENTS = 1 << 34
MAX_RANKS = 1 << 16
MAX_ENTRIES = 1 << 22

_RANK_FILE = re.compile(r"^(?:rank)?(\d+)\.json$")


class TraceError(ValueError):
    """A trace file or directory that cannot be read as a PARAM comms trace (names what is wrong)."""


@dataclass(frozen=True)
class CommEntry:
    """One entry of a rank's trace: an op, a wait or a group's ``init``."""

    comms: str
    req: int | None = None
    pg_id: int | None = None
    global_ranks: tuple[int, ...] = ()
    in_msg_size: int = 0
    out_msg_size: int = 0
    dtype: str | None = None  # a PARAM name (DTYPES)
    in_split: tuple[int, ...] | None = None
    out_split: tuple[int, ...] | None = None
    root: int | None = None
    src_rank: int | None = None
    dst_rank: int | None = None
    reduce_op: str | None = None
    start_ns: int = 0
    duration_ns: int = 0
    step: int = 0
    markers: tuple[str, ...] = field(default=())

    @property
    def world_size(self) -> int:
        return len(self.global_ranks)

    def shape_key(self) -> tuple[Any, ...]:
        """What a replay must reproduce of this entry: the op, its group, sizes, splits, dtype and peers
        (not its timing, request id or markers)."""
        return (self.comms, self.global_ranks, self.in_msg_size, self.out_msg_size, self.dtype, self.in_split,
                self.out_split, self.root, self.src_rank, self.dst_rank, self.reduce_op)

    def to_json(self) -> dict[str, Any]:
        """PARAM's keys (and commd's), absent ones left out."""
        out: dict[str, Any] = {"comms": self.comms}
        if self.req is not None:
            out["req"] = self.req
        if self.pg_id is not None:
            out["pg_id"] = self.pg_id
        if self.global_ranks:
            out["global_ranks"] = list(self.global_ranks)
            out["world_size"] = len(self.global_ranks)
        if self.comms not in SIZELESS:
            out["in_msg_size"] = self.in_msg_size
            out["out_msg_size"] = self.out_msg_size
            out["dtype"] = self.dtype
        for key in ("in_split", "out_split"):
            value = getattr(self, key)
            if value is not None:
                out[key] = list(value)
        for key in ("root", "src_rank", "dst_rank", "reduce_op"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.comms in POINT_TO_POINT:
            out["use_batch"] = False
        if self.comms != "init":
            out["startTime_ns"] = self.start_ns
            out["duration_ns"] = self.duration_ns
            out["step"] = self.step
        if self.markers:
            out["markers"] = list(self.markers)
        return out


def _int(raw: dict[str, Any], key: str, where: str, low: int = 0, high: int = MAX_ELEMENTS,
         default: int | None = None) -> int | None:
    value = raw.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise TraceError(f"{where}: {key} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _ints(raw: dict[str, Any], key: str, where: str, high: int) -> tuple[int, ...] | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > MAX_RANKS:
        raise TraceError(f"{where}: {key} must be a list of at most {MAX_RANKS} integers, got {type(value).__name__}")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item <= high:
            raise TraceError(f"{where}: {key} must hold integers in [0, {high}], got {item!r}")
    return tuple(value)


def entry_from_json(raw: Any, where: str) -> CommEntry:
    """One validated entry; TraceError naming ``where`` and the field otherwise."""
    if not isinstance(raw, dict):
        raise TraceError(f"{where}: an entry must be a JSON object, got {type(raw).__name__}")
    if "compute" in raw and "comms" not in raw:
        raise TraceError(f"{where}: compute entries are not replayed by commd (only comms entries)")
    comms = raw.get("comms")
    if not isinstance(comms, str) or comms.lower() not in COMMS:
        raise TraceError(f"{where}: comms must be one of {', '.join(COMMS)}, got {comms!r}")
    comms = comms.lower()
    ranks = _ints(raw, "global_ranks", where, MAX_RANKS) or ()
    if len(set(ranks)) != len(ranks):
        raise TraceError(f"{where}: global_ranks repeats a rank: {list(ranks)}")
    world = _int(raw, "world_size", where, 0, MAX_RANKS)
    if world is not None and ranks and world != len(ranks):
        raise TraceError(f"{where}: world_size {world} but global_ranks has {len(ranks)} ranks")
    values: dict[str, Any] = {"comms": comms, "global_ranks": ranks}
    values["req"] = _int(raw, "req", where, -1, 1 << 62)
    values["pg_id"] = _int(raw, "pg_id", where, 0, 1 << 31)
    if comms in ("wait",) and values["req"] is None:
        raise TraceError(f"{where}: a wait must name the req it waits for")
    if comms == "init" and (values["pg_id"] is None or not ranks):
        raise TraceError(f"{where}: an init entry needs pg_id and global_ranks")
    if comms not in SIZELESS:
        values["in_msg_size"] = _int(raw, "in_msg_size", where)
        values["out_msg_size"] = _int(raw, "out_msg_size", where)
        if values["in_msg_size"] is None or values["out_msg_size"] is None:
            raise TraceError(f"{where}: {comms} needs in_msg_size and out_msg_size (elements)")
        dtype = raw.get("dtype")
        if not isinstance(dtype, str) or dtype.lower() not in DTYPES:
            raise TraceError(f"{where}: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        values["dtype"] = dtype.lower()
    if comms in ("all_to_allv", "all_to_all"):
        for key, total in (("in_split", "in_msg_size"), ("out_split", "out_msg_size")):
            split = _ints(raw, key, where, MAX_ELEMENTS)
            if split is not None:
                if ranks and len(split) != len(ranks):
                    raise TraceError(f"{where}: {key} has {len(split)} entries for a group of {len(ranks)} ranks")
                if sum(split) != values[total]:
                    raise TraceError(f"{where}: {key} sums to {sum(split)}, but {total} is {values[total]}")
            values[key] = split
    if comms in ROOTED:
        values["root"] = _int(raw, "root", where, 0, MAX_RANKS)
        if values["root"] is None:
            raise TraceError(f"{where}: {comms} needs its root (a global rank)")
    if comms in POINT_TO_POINT:
        values["src_rank"] = _int(raw, "src_rank", where, 0, MAX_RANKS)
        values["dst_rank"] = _int(raw, "dst_rank", where, 0, MAX_RANKS)
        if values["src_rank"] is None or values["dst_rank"] is None:
            raise TraceError(f"{where}: {comms} needs src_rank and dst_rank (global ranks)")
    for key in ("root", "src_rank", "dst_rank"):
        if ranks and values.get(key) is not None and values[key] not in ranks:
            raise TraceError(f"{where}: {key} {values[key]} is not in the group's global_ranks {list(ranks)}")
    reduce_op = raw.get("reduce_op")
    if reduce_op is not None and (not isinstance(reduce_op, str) or reduce_op not in REDUCE_OPS):
        raise TraceError(f"{where}: reduce_op must be one of {', '.join(REDUCE_OPS)}, got {reduce_op!r}")
    values["reduce_op"] = reduce_op
    values["start_ns"] = _int(raw, "startTime_ns", where, 0, 1 << 63, 0)
    values["duration_ns"] = _int(raw, "duration_ns", where, 0, 1 << 63, 0)
    values["step"] = _int(raw, "step", where, 0, 1 << 40, 0)
    markers = raw.get("markers") or []
    if not isinstance(markers, list) or not all(isinstance(m, str) for m in markers):
        raise TraceError(f"{where}: markers must be a list of strings")
    values["markers"] = tuple(markers)
    return CommEntry(**values)


def load_rank(path: Path | str) -> list[CommEntry]:
    """One rank's trace, every entry validated."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise TraceError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: not JSON: {exc}") from None
    if not isinstance(raw, list):
        raise TraceError(f"{path}: a trace must be a JSON list of entries, got {type(raw).__name__}")
    if len(raw) > MAX_ENTRIES:
        raise TraceError(f"{path}: {len(raw)} entries, more than the {MAX_ENTRIES} a trace may hold")
    return [entry_from_json(item, f"{path} entry {i}") for i, item in enumerate(raw)]


def rank_files(directory: Path | str) -> dict[int, Path]:
    """The trace files of a directory by global rank; TraceError if there are none, a rank has two, or
    ranks 0..W-1 are not all there."""
    directory = Path(directory)
    if not directory.is_dir():
        raise TraceError(f"{directory}: not a directory of per-rank traces (rank<R>.json)")
    found: dict[int, Path] = {}
    for path in sorted(directory.iterdir()):
        match = _RANK_FILE.match(path.name)
        if match is None:
            continue
        rank = int(match.group(1))
        if rank in found:
            raise TraceError(f"{directory}: two traces for rank {rank}: {found[rank].name} and {path.name}")
        found[rank] = path
    if not found:
        raise TraceError(f"{directory}: no trace files (rank<R>.json)")
    missing = sorted(set(range(max(found) + 1)) - set(found))
    if missing:
        raise TraceError(f"{directory}: no trace for rank(s) {missing} (have {sorted(found)})")
    return found


def load_dir(directory: Path | str) -> dict[int, list[CommEntry]]:
    """Every rank's trace of a directory, and a consistent group table across them (``groups``)."""
    traces = {rank: load_rank(path) for rank, path in rank_files(directory).items()}
    groups(traces)
    return traces


def groups(traces: dict[int, list[CommEntry]]) -> dict[int, tuple[int, ...]]:
    """The job's process groups, pg_id → global ranks, from every rank's entries; TraceError if two
    entries give one pg_id different ranks, a rank's entry names a group it is not in, or a rank is
    outside the job."""
    world = len(traces)
    table: dict[int, tuple[int, ...]] = {}
    for rank, entries in traces.items():
        for i, entry in enumerate(entries):
            if entry.pg_id is None or not entry.global_ranks:
                continue
            outside = [r for r in entry.global_ranks if r >= world]
            if outside:
                raise TraceError(f"rank {rank} entry {i}: global_ranks {outside} outside a job of {world} ranks")
            known = table.setdefault(entry.pg_id, entry.global_ranks)
            if known != entry.global_ranks:
                raise TraceError(f"rank {rank} entry {i}: pg_id {entry.pg_id} has ranks {list(entry.global_ranks)} "
                                 f"here, {list(known)} elsewhere")
            if entry.comms != "init" and rank not in entry.global_ranks:
                raise TraceError(f"rank {rank} entry {i}: {entry.comms} on pg_id {entry.pg_id}, a group without "
                                 f"rank {rank}")
    return table


def ops_of(entries: list[CommEntry]) -> list[CommEntry]:
    """The entries that move data or synchronize (not waits, not group inits)."""
    return [e for e in entries if e.comms not in ("wait", "init")]


def write_rank(path: Path | str, entries: list[CommEntry]) -> None:
    """Write one rank's trace atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps([e.to_json() for e in entries], indent=0) + "\n")
    os.replace(tmp, path)


def rank_path(directory: Path | str, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.json"


# ---- what a replay needs beyond each file being valid ----------------------------------------
#: Collectives whose members must agree on the input size, and those on the output size.
_SAME_IN = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_base", "gather")
_SAME_OUT = ("reduce_scatter", "reduce_scatter_base", "scatter")
_ALL_TO_ALL = ("all_to_allv", "all_to_all")

#: A process group as a replay knows it: its pg_id (None: the entry named none) and its global ranks.
GroupKey = tuple[int | None, tuple[int, ...]]


def group_of(entry: CommEntry, table: dict[int, tuple[int, ...]], world: int) -> tuple[int, ...]:
    """The global ranks ``entry`` runs on: its own ``global_ranks``, else its pg_id's (``groups``), else the
    whole job (an entry that names no group); TraceError if it names a pg_id no entry lists ranks for."""
    if entry.global_ranks:
        return entry.global_ranks
    if entry.pg_id is None:
        return tuple(range(world))
    if entry.pg_id not in table:
        raise TraceError(f"pg_id {entry.pg_id} names a group whose ranks no entry lists (no init entry, no "
                         "global_ranks)")
    return table[entry.pg_id]


def group_key(entry: CommEntry, table: dict[int, tuple[int, ...]], world: int) -> GroupKey:
    """The group ``entry`` runs on in a replay: (pg_id, ranks), and (None, every rank) for any group of the
    whole job (a replay runs those on its default group, so their ops form one sequence)."""
    ranks = group_of(entry, table, world)
    return (None, ranks) if len(ranks) == world else (entry.pg_id, ranks)


def splits_of(entry: CommEntry, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """An all-to-all's (in, out) elements per group rank: its splits, else its sizes shared evenly."""
    ins = entry.in_split if entry.in_split is not None else (entry.in_msg_size // n,) * n
    outs = entry.out_split if entry.out_split is not None else (entry.out_msg_size // n,) * n
    return ins, outs


def _check_sizes(entry: CommEntry, n: int, where: str) -> None:
    """An op's sizes against its group's size n (what every rank's buffers must hold)."""
    c, i, o = entry.comms, entry.in_msg_size, entry.out_msg_size
    if c in ("all_gather", "all_gather_base", "gather") and o != i * n:
        raise TraceError(f"{where}: {c} on {n} ranks needs out_msg_size = {n} x in_msg_size = {i * n}, got {o}")
    if c in ("reduce_scatter", "reduce_scatter_base", "scatter") and i != o * n:
        raise TraceError(f"{where}: {c} on {n} ranks needs in_msg_size = {n} x out_msg_size = {o * n}, got {i}")
    if c in _ALL_TO_ALL:
        for key, split, total in (("in_split", entry.in_split, i), ("out_split", entry.out_split, o)):
            if split is None and total % n:
                raise TraceError(f"{where}: {c} without {key} shares {total} elements evenly over {n} ranks, "
                                 "which does not divide")
            if split is not None and len(split) != n:
                raise TraceError(f"{where}: {key} has {len(split)} entries for a group of {n} ranks")


def match_collectives(traces: dict[int, list[CommEntry]]) -> dict[tuple[int, int], tuple[CommEntry, ...]]:
    """Check that the traces replay together, and pair each collective with its group's.

    Every group's members must issue the same collectives in the same order (op, dtype, root,
    reduce op, fitting sizes and splits), every send must meet its receive, and every wait must
    name a request an earlier op of its rank issued; steps never go back.  Returns, for each
    collective (rank, entry index), the matching entry of every member of its group, in group
    order.  TraceError naming the rank, the entry and the field otherwise."""
    table = groups(traces)
    world = len(traces)
    sequences: dict[GroupKey, dict[int, list[int]]] = {}
    p2p: dict[tuple[GroupKey, int, int, str], list[tuple[int, int]]] = {}
    for rank, entries in traces.items():
        issued: set[int] = set()
        last_step = 0
        for i, e in enumerate(entries):
            where = f"rank {rank} entry {i}"
            if e.comms == "init":
                continue
            if e.step < last_step:
                raise TraceError(f"{where}: step goes back from {last_step} to {e.step}")
            last_step = e.step
            if e.comms == "wait":
                if e.req not in issued:
                    raise TraceError(f"{where}: wait for req {e.req}, which no earlier op of rank {rank} issued")
                continue
            if e.req is not None:
                issued.add(e.req)
            try:
                key = group_key(e, table, world)
            except TraceError as exc:
                raise TraceError(f"{where}: {exc}") from None
            ranks = key[1]
            if list(ranks) != sorted(ranks):
                raise TraceError(f"{where}: global_ranks {list(ranks)} out of order: a group's ranks are listed in "
                                 "ascending order (its group ranks, as torch numbers them)")
            if rank not in ranks:
                raise TraceError(f"{where}: {e.comms} on group {list(ranks)}, which does not hold rank {rank}")
            for field_name in ("root", "src_rank", "dst_rank"):
                value = getattr(e, field_name)
                if value is not None and value not in ranks:
                    raise TraceError(f"{where}: {field_name} {value} is not in the group's ranks {list(ranks)}")
            _check_sizes(e, len(ranks), where)
            if e.comms in POINT_TO_POINT:
                me, peer = (e.src_rank, e.dst_rank) if e.comms == "send" else (e.dst_rank, e.src_rank)
                if me != rank:
                    field_name = "src_rank" if e.comms == "send" else "dst_rank"
                    raise TraceError(f"{where}: {e.comms} with {field_name} {me} in rank {rank}'s trace")
                if peer == rank:
                    raise TraceError(f"{where}: {e.comms} to itself (rank {rank})")
                pair = (e.src_rank, e.dst_rank)
                p2p.setdefault((key, *pair, e.comms), []).append((rank, i))
                continue
            sequences.setdefault(key, {}).setdefault(rank, []).append(i)
    matched: dict[tuple[int, int], tuple[CommEntry, ...]] = {}
    for key, per_rank in sequences.items():
        ranks = key[1]
        counts = {r: len(per_rank.get(r, [])) for r in ranks}
        if len(set(counts.values())) > 1:
            raise TraceError(f"group pg_id {key[0]} (ranks {list(ranks)}): its ranks issue different numbers of "
                             f"collectives on it: {', '.join(f'rank {r}: {c}' for r, c in counts.items())}")
        for k in range(counts[ranks[0]]):
            row = tuple(traces[r][per_rank[r][k]] for r in ranks)
            _check_row(row, ranks, [per_rank[r][k] for r in ranks])
            for r in ranks:
                matched[(r, per_rank[r][k])] = row
    for (key, src, dst, comms), items in p2p.items():
        if comms != "send":
            continue
        recvs = p2p.get((key, src, dst, "recv"), [])
        _check_pairs(traces, items, recvs, src, dst)
    for (key, src, dst, comms), items in p2p.items():
        if comms == "recv" and (key, src, dst, "send") not in p2p:
            rank, i = items[0]
            raise TraceError(f"rank {rank} entry {i}: recv from rank {src}, which never sends to rank {dst} on "
                             f"group {list(key[1])}")
    return matched


def _check_row(row: tuple[CommEntry, ...], ranks: tuple[int, ...], indices: list[int]) -> None:
    """The k-th collective of one group on each of its members: they must be one op."""
    first, n = row[0], len(ranks)

    def differ(field_name: str, values: list[Any]) -> TraceError:
        shown = ", ".join(f"rank {r} entry {i}: {v!r}" for r, i, v in zip(ranks, indices, values, strict=True))
        return TraceError(f"{first.comms if field_name != 'comms' else 'collective'} on group {list(ranks)}: "
                          f"its ranks disagree on {field_name} ({shown})")

    for field_name in ("comms", "dtype", "root"):
        values = [getattr(e, field_name) for e in row]
        if len(set(values)) > 1:
            raise differ(field_name, values)
    values = [e.reduce_op or "sum" for e in row]
    if first.comms in ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_base") and len(set(values)) > 1:
        raise differ("reduce_op", values)
    if first.comms in _SAME_IN and len({e.in_msg_size for e in row}) > 1:
        raise differ("in_msg_size", [e.in_msg_size for e in row])
    if first.comms in _SAME_OUT and len({e.out_msg_size for e in row}) > 1:
        raise differ("out_msg_size", [e.out_msg_size for e in row])
    if first.comms in _ALL_TO_ALL:
        splits = [splits_of(e, n) for e in row]
        for a in range(n):
            for b in range(n):
                sent, received = splits[a][0][b], splits[b][1][a]
                if sent != received:
                    raise TraceError(f"{first.comms} on group {list(ranks)}: rank {ranks[a]} entry {indices[a]} "
                                     f"sends {sent} elements to rank {ranks[b]} (in_split), whose entry "
                                     f"{indices[b]} expects {received} (out_split)")


def _check_pairs(traces: dict[int, list[CommEntry]], sends: list[tuple[int, int]], recvs: list[tuple[int, int]],
                 src: int, dst: int) -> None:
    """The sends from ``src`` to ``dst`` on a group and the receives that match them, in order."""
    if len(sends) != len(recvs):
        raise TraceError(f"rank {src} sends {len(sends)} messages to rank {dst}, which receives {len(recvs)} from it "
                         f"(rank {src} entry {sends[0][1]} is the first send)")
    for (sr, si), (rr, ri) in zip(sends, recvs, strict=True):
        s, r = traces[sr][si], traces[rr][ri]
        if (s.in_msg_size, s.dtype) != (r.in_msg_size, r.dtype):
            raise TraceError(f"rank {sr} entry {si} sends {s.in_msg_size} {s.dtype} to rank {dst}, whose matching "
                             f"recv (entry {ri}) takes {r.in_msg_size} {r.dtype}")
