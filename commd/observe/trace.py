"""The per-op timeline: Chrome / Perfetto trace-event JSON, one file per node.

Per op and node, its phases as nested async slices (``b``/``e`` pairs of one
id, so ops of one group that overlap in time stay apart):

- ``submit``: the first local rank submitted → every local rank is in;
- ``negotiate``: → the coordinator's release (ops spanning nodes only);
- ``queue``: → its lane starts it;
- ``lane``: lane start → lane end (also an ``X`` slice on the lane's track); for an all-reduce
  between nodes, in its three steps instead: ``local`` (the node's ranks reduced into one
  buffer), ``wire`` (the lane's exchange between the nodes), ``out`` (the result copied out to
  the node's other ranks);
- ``reply``: → the ranks were answered.

pid = node rank, tids are the lanes and groups (named by metadata events).
Events are appended (by a writer thread) as ops complete, to a hidden file beside the
trace (``.<name>.partial``); ``close`` ends the JSON array and renames it to the trace's
name, so whoever reads the trace reads a whole one.  All-reduces a group's exchange ring
ran are traced from the times its first rank sends (``ring_ops``, lane ``ring``): every
op is in the trace, whatever path ran it.  Instant marks (``instant``, on a ``membership`` track) show a
rank gone and each recovery ``commd.ft`` reported.
When tracing is off the daemon holds a ``NullTrace``, whose ``on`` is False:
each hook is one attribute test.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger("commd.trace")

CATEGORY = "commd"
#: Buffered writes: events reach the file in blocks, and at close.
WRITE_BUFFER_BYTES = 1 << 20


@dataclass(frozen=True)
class _Instant:
    """A queued ``Tracer.instant`` mark (the writer tells it from an op's record by its type)."""

    name: str
    args: dict[str, Any]
    at: float  # time.monotonic()


class TraceError(Exception):
    """A trace cannot be started or stopped (bad path, already on, ...)."""


class NullTrace:
    """Tracing off: every hook is skipped behind ``if tracer.on``."""

    on = False
    path: str | None = None

    def wrap(self, ops: Iterable[Any], work: Callable[[float], None]) -> Callable[[float], None]:
        return work

    def marker(self, op: Any) -> Callable[[str], None] | None:
        return None


def node_trace_path(path: str, node: int | None) -> str:
    """Where one node writes: ``path`` itself on a single node, ``<stem>.node<k><suffix>`` in a fabric."""
    if node is None:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.node{node}{p.suffix}"))


def check_trace_path(raw: Any, where: str) -> str:
    """An absolute path a trace may be written to (validated; the file is created later)."""
    if not isinstance(raw, str) or not raw or "\0" in raw:
        raise TraceError(f"{where} must be a file path")
    path = Path(raw).expanduser()
    if not path.is_absolute():
        raise TraceError(f"{where} {raw!r} must be an absolute path")
    if path.is_dir():
        raise TraceError(f"{where} {raw!r} is a directory, not a file")
    if not path.parent.is_dir():
        raise TraceError(f"{where} {raw!r}: directory {str(path.parent)!r} does not exist")
    return str(path)


class Tracer:
    """Writes one node's timeline.

    The hooks only take timestamps: ``mark`` (any thread) and ``op_done`` (the
    loop) cost a few dictionary operations and one queue put; a writer thread
    turns the records into JSON text in batches, off the ops' path.
    """

    on = True

    def __init__(self, path: str, node: int, node_name: str) -> None:
        self.path = path
        self.node = node
        # written beside ``path`` and renamed to it once closed: whoever reads ``path`` reads a whole trace
        self._partial = str(Path(path).with_name(f".{Path(path).name}.partial"))
        try:
            fd = os.open(self._partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
        except OSError as exc:
            raise TraceError(f"cannot write the trace to {path}: {exc.strerror or exc}") from None
        self._file: TextIO | None = os.fdopen(fd, "w", buffering=WRITE_BUFFER_BYTES)
        # Monotonic clock → microseconds since the epoch, so nodes' files line up when merged.
        self._offset = time.time() - time.monotonic()
        self._marks: dict[int, dict[str, float]] = {}
        self._records: queue.SimpleQueue[tuple | _Instant | None] = queue.SimpleQueue()
        # Writer thread only:
        self._tids: dict[str, int] = {}
        self._json: dict[str, str] = {}
        self._next_id = 0
        self.events = 0
        self._write_text(json.dumps({"ph": "M", "name": "process_name", "pid": node, "tid": 0,
                                     "args": {"name": f"node {node} ({node_name})"}}), first=True)
        self._write_text(json.dumps({"ph": "M", "name": "process_sort_index", "pid": node, "tid": 0,
                                     "args": {"sort_index": node}}))
        self._writer = threading.Thread(target=self._writer_main, name="commd-trace-writer", daemon=True)
        self._writer.start()

    # ---- hooks -------------------------------------------------------------------
    def mark(self, op: Any, what: str) -> None:
        """Record when ``op`` reached ``what`` (released, start, end); any thread."""
        self._marks.setdefault(id(op), {})[what] = time.monotonic()

    def marker(self, op: Any) -> Callable[[str], None] | None:
        """``mark`` bound to ``op``: for code that knows its steps but not the tracer (execution)."""
        return lambda what: self.mark(op, what)

    def wrap(self, ops: Iterable[Any], work: Callable[[float], None]) -> Callable[[float], None]:
        """``work`` (a lane call for ``ops``) with its start and end marked."""
        ops = list(ops)

        def timed(cap: float) -> None:
            for op in ops:
                self.mark(op, "start")
            try:
                work(cap)
            finally:
                for op in ops:
                    self.mark(op, "end")

        return timed

    def timed_run(self, op: Any, run: Callable[[Any], Any]) -> Any:
        """``run(op)`` (a local execution) with its start and end marked."""
        self.mark(op, "start")
        try:
            return run(op)
        finally:
            self.mark(op, "end")

    def op_done(self, op: Any, error: str | None) -> None:
        """The op was answered: queue its record for the writer (loop thread)."""
        marks = self._marks.pop(id(op), None) or {}
        self._records.put((op.kind, op.group, op.seq, op.nbytes, op.lane, [sub.group_rank for sub in op.subs],
                           op.first_at, op.ready_at, marks, time.monotonic(), error,
                           op.describe() if op.kind == "sendrecv" else None))

    def ring_ops(self, group: str, ranks: list[int], records: list[list[Any]]) -> None:
        """All-reduces an exchange ring ran (``protocol/fastring.py``: a rank sends their times): traced
        as the daemon's own ops, lane ``ring``, phases submit (posted → every input in) and lane (the
        reduction, copy-out included).  Records were checked by ``check_ring_records``."""
        for number, nbytes, posted, inputs_in, done, error in records:
            self._records.put(("allreduce", group, number, nbytes, "ring", ranks, posted, inputs_in,
                               {"start": inputs_in, "end": done}, done, error, None))

    def instant(self, name: str, args: dict[str, Any]) -> None:
        """A mark at this moment on the node's ``membership`` track (a rank gone, a recovery ``commd.ft``
        reported): an instant event across the node's tracks, so the ops around it show what it cost."""
        self._records.put(_Instant(name, args, time.monotonic()))

    def close(self) -> None:
        """Write what is queued and close the JSON array: the file is valid JSON from then on."""
        if self._file is None:
            return
        self._records.put(None)
        self._writer.join(timeout=30)
        file, self._file = self._file, None
        try:
            file.write("\n]\n")
            file.close()
            os.replace(self._partial, self.path)
        except OSError as exc:
            log.warning("cannot finish the trace %s: %s", self.path, exc)
        log.info("trace of %d events written to %s", self.events, self.path)

    # ---- the writer thread -------------------------------------------------------
    def _writer_main(self) -> None:
        while True:
            batch = [self._records.get()]
            while len(batch) < 4096:
                try:
                    batch.append(self._records.get_nowait())
                except queue.Empty:
                    break
            stop = batch[-1] is None
            try:
                text = "".join(self._format_instant(record) if isinstance(record, _Instant) else self._format(record)
                               for record in batch if record is not None)
            except Exception:  # a bad record must not end the trace
                log.exception("trace %s: cannot format a batch of %d ops", self.path, len(batch))
                text = ""
            self._write_text(text, raw=True)
            if stop:
                return

    def _js(self, value: str) -> str:
        """``value`` as a JSON string (cached: groups, lanes and kinds repeat)."""
        text = self._json.get(value)
        if text is None:
            text = self._json[value] = json.dumps(value)
        return text

    def _tid(self, track: str, out: list[str]) -> int:
        tid = self._tids.get(track)
        if tid is None:
            tid = self._tids[track] = len(self._tids) + 1
            out.append(f',\n{{"ph":"M","name":"thread_name","pid":{self.node},"tid":{tid},'
                       f'"args":{{"name":{self._js(track)}}}}}')
            self.events += 1
        return tid

    def _format(self, record: tuple) -> str:
        kind, group, seq, nbytes, lane, ranks, first_at, ready_at, marks, done, error, label = record
        out: list[str] = []
        node = self.node
        self._next_id += 1
        group_tid = self._tid(f"group {group}", out)
        name = self._js(label if label is not None else f"{kind} #{seq}")
        args = (f'{{"kind":{self._js(kind)},"group":{self._js(group)},"seq":{seq},"bytes":{nbytes},'
                f'"lane":{self._js(lane)},"ranks":[{",".join(map(str, ranks))}],"node":{node}'
                + (f',"error":{json.dumps(error)}}}' if error is not None else "}"))
        head = f',\n{{"cat":"{CATEGORY}","id":{self._next_id},"pid":{node},"tid":{group_tid},'
        offset = self._offset
        points = [("submit", first_at)]
        released, scheduled = marks.get("released"), marks.get("scheduled")
        if released is not None:
            points += [("negotiate", ready_at), ("queue", released)]
        elif scheduled is not None:  # the schedule path: released here, agreed with the op's nodes
            points += [("schedule", ready_at), ("queue", scheduled)]
        else:
            points.append(("queue", ready_at))
        start, end, agreed = marks.get("start"), marks.get("end"), marks.get("agreed")
        reduced, exchanged = marks.get("reduced"), marks.get("exchanged")
        if start is not None:
            points.append(("agree" if agreed is not None else "lane", start))
        if agreed is not None:
            points.append(("lane", agreed))
        if reduced is not None and exchanged is not None and start is not None:
            # an all-reduce between nodes: its lane phase as its three steps, one after another
            points[-1] = ("local", points[-1][1])
            points += [("wire", reduced), ("out", exchanged)]
        if end is not None:
            points.append(("reply", end))
        out.append(f'{head}"ph":"b","name":{name},"ts":{(first_at + offset) * 1e6:.3f},"args":{args}}}')
        ends = [p[1] for p in points[1:]] + [done]
        for (phase, begin), finish in zip(points, ends, strict=True):
            out.append(f'{head}"ph":"b","name":"{phase}","ts":{(begin + offset) * 1e6:.3f}}}')
            out.append(f'{head}"ph":"e","name":"{phase}","ts":{(max(begin, finish) + offset) * 1e6:.3f}}}')
        out.append(f'{head}"ph":"e","name":{name},"ts":{(done + offset) * 1e6:.3f}}}')
        if start is not None and end is not None:
            out.append(f',\n{{"ph":"X","cat":"{CATEGORY}","name":{name},"pid":{node},'
                       f'"tid":{self._tid(f"lane {lane}", out)},"ts":{(start + offset) * 1e6:.3f},'
                       f'"dur":{(end - start) * 1e6:.3f},"args":{args}}}')
        self.events += 2 * len(points) + 2 + (start is not None and end is not None)
        return "".join(out)

    def _format_instant(self, mark: _Instant) -> str:
        out: list[str] = []
        tid = self._tid("membership", out)
        out.append(f',\n{{"ph":"i","s":"p","cat":"{CATEGORY}","name":{json.dumps(mark.name)},"pid":{self.node},'
                   f'"tid":{tid},"ts":{(mark.at + self._offset) * 1e6:.3f},"args":{json.dumps(mark.args)}}}')
        self.events += 1
        return "".join(out)

    def _write_text(self, text: str, first: bool = False, raw: bool = False) -> None:
        if self._file is None or not text:
            return
        try:
            self._file.write(text if raw else ("[\n" if first else ",\n") + text)
            if not raw:
                self.events += 1
        except (OSError, ValueError) as exc:  # ValueError: closed meanwhile
            log.error("trace %s: write failed (%s); tracing stops", self.path, exc)
            self._file = None


#: The most traced ring ops one message may carry.
MAX_RING_RECORDS = 256


def check_ring_records(raw: Any) -> list[list[Any]]:
    """A rank's traced ring ops (``ExchangeRing.on_trace``), checked: ValueError naming what is wrong."""
    if type(raw) is not list or not 1 <= len(raw) <= MAX_RING_RECORDS:
        raise ValueError(f"'trace' must be a list of 1 to {MAX_RING_RECORDS} ring ops")
    now = time.monotonic()
    for record in raw:
        if type(record) is not list or len(record) != 6:
            raise ValueError("a traced ring op is [number, bytes, posted, inputs in, done, error]")
        number, nbytes, *times, error = record
        if type(number) is not int or type(nbytes) is not int or number < 0 or nbytes < 0:
            raise ValueError("a traced ring op's number and bytes must be integers >= 0")
        if not all(type(t) is float and now - 86400 <= t <= now + 1 for t in times) or not times[0] <= times[2]:
            raise ValueError("a traced ring op's times must be this host's monotonic clock, in order")
        if error is not None and (type(error) is not str or len(error) > 4096):
            raise ValueError("a traced ring op's error must be a string (4096 characters at most) or nil")
    return raw


def merge(inputs: list[str], output: str) -> int:
    """Join nodes' trace files into one (an unfinished file is accepted); returns the event count."""
    events: list[Any] = []
    for path in inputs:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise TraceError(f"cannot read {path}: {exc.strerror or exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            try:  # a node that did not shut down cleanly left the array open
                data = json.loads(text.rstrip().rstrip(",") + "\n]")
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path} is not a trace-event JSON file: {exc}") from None
        if isinstance(data, dict):
            data = data.get("traceEvents")
        if not isinstance(data, list):
            raise TraceError(f"{path} is not a trace-event JSON file (no event list)")
        events.extend(data)
    with open(output, "w") as out:
        json.dump(events, out, separators=(",", ":"))
    return len(events)
