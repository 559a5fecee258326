"""The per-op timeline: Chrome / Perfetto trace-event JSON, one file per node.

Per op and node, its phases as nested async slices (``b``/``e`` pairs of one
id, so ops of one group that overlap in time stay apart):

- ``submit``: the first local rank submitted → every local rank is in;
- ``negotiate``: → the coordinator's release (ops spanning nodes only);
- ``queue``: → its lane starts it;
- ``lane``: lane start → lane end (also an ``X`` slice on the lane's track);
- ``reply``: → the ranks were answered.

pid = node rank, tids are the lanes and groups (named by metadata events).
Events are appended as ops complete and the JSON array is closed on ``close``.
When tracing is off the daemon holds a ``NullTrace``, whose ``on`` is False:
each hook is one attribute test.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger("commd.trace")

CATEGORY = "commd"
#: Buffered writes: events reach the file in blocks, and at close.
WRITE_BUFFER_BYTES = 1 << 20


class TraceError(Exception):
    """A trace cannot be started or stopped (bad path, already on, ...)."""


class NullTrace:
    """Tracing off: every hook is skipped behind ``if tracer.on``."""

    on = False
    path: str | None = None

    def wrap(self, ops: Iterable[Any], work: Callable[[float], None]) -> Callable[[float], None]:
        return work


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
    """Writes one node's timeline; hooks run on the loop, lane marks on any thread."""

    on = True

    def __init__(self, path: str, node: int, node_name: str) -> None:
        self.path = path
        self.node = node
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise TraceError(f"cannot write the trace to {path}: {exc.strerror or exc}") from None
        self._file: TextIO | None = os.fdopen(fd, "w", buffering=WRITE_BUFFER_BYTES)
        # Monotonic clock → microseconds since the epoch, so nodes' files line up when merged.
        self._offset = time.time() - time.monotonic()
        self._marks: dict[int, dict[str, float]] = {}
        self._tids: dict[str, int] = {}
        self._next_id = 0
        self._lock = threading.Lock()
        self.events = 0
        self._write({"ph": "M", "name": "process_name", "pid": node, "tid": 0,
                     "args": {"name": f"node {node} ({node_name})"}}, first=True)
        self._write({"ph": "M", "name": "process_sort_index", "pid": node, "tid": 0, "args": {"sort_index": node}})

    # ---- hooks -------------------------------------------------------------------
    def mark(self, op: Any, what: str) -> None:
        """Record when ``op`` reached ``what`` (released, start, end); any thread."""
        now = time.monotonic()
        marks = self._marks.get(id(op))
        if marks is None:
            with self._lock:
                marks = self._marks.setdefault(id(op), {})
        marks[what] = now

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
        """The op was answered: write its phases (loop thread)."""
        with self._lock:
            marks = self._marks.pop(id(op), {})
        if self._file is None:
            return
        done = time.monotonic()
        self._next_id += 1
        op_id = self._next_id
        group_tid = self._tid(f"group {op.group}")
        name = op.describe() if op.kind == "sendrecv" else f"{op.kind} #{op.seq}"
        args: dict[str, Any] = {
            "kind": op.kind, "group": op.group, "seq": op.seq, "bytes": op.nbytes, "lane": op.lane,
            "ranks": [sub.group_rank for sub in op.subs], "node": self.node,
        }
        if error is not None:
            args["error"] = error
        points = [("submit", op.first_at), ("negotiate", op.ready_at)]
        released = marks.get("released")
        if released is not None:
            points.append(("queue", released))
        else:
            points[-1] = ("queue", op.ready_at)
        start, end = marks.get("start"), marks.get("end")
        if start is not None:
            points.append(("lane", start))
        if end is not None:
            points.append(("reply", end))
        base = {"cat": CATEGORY, "id": op_id, "pid": self.node, "tid": group_tid}
        self._write(dict(base, ph="b", name=name, ts=self._us(op.first_at), args=args))
        for (phase, begin), nxt in zip(points, [p[1] for p in points[1:]] + [done], strict=True):
            self._write(dict(base, ph="b", name=phase, ts=self._us(begin)))
            self._write(dict(base, ph="e", name=phase, ts=self._us(max(begin, nxt))))
        self._write(dict(base, ph="e", name=name, ts=self._us(done)))
        if start is not None and end is not None:
            self._write({"ph": "X", "cat": CATEGORY, "name": name, "pid": self.node,
                         "tid": self._tid(f"lane {op.lane}"), "ts": self._us(start),
                         "dur": round((end - start) * 1e6, 3), "args": args})

    def close(self) -> None:
        """Close the JSON array: the file is valid JSON from now on."""
        if self._file is None:
            return
        file, self._file = self._file, None
        try:
            file.write("\n]\n")
            file.close()
        except OSError as exc:
            log.warning("cannot finish the trace %s: %s", self.path, exc)
        log.info("trace of %d events written to %s", self.events, self.path)

    # ---- writing -----------------------------------------------------------------
    def _us(self, t: float) -> float:
        return round((t + self._offset) * 1e6, 3)

    def _tid(self, track: str) -> int:
        tid = self._tids.get(track)
        if tid is None:
            tid = self._tids[track] = len(self._tids) + 1
            self._write({"ph": "M", "name": "thread_name", "pid": self.node, "tid": tid, "args": {"name": track}})
        return tid

    def _write(self, event: dict[str, Any], first: bool = False) -> None:
        if self._file is None:
            return
        try:
            self._file.write(("[\n" if first else ",\n") + json.dumps(event, separators=(",", ":")))
            self.events += 1
        except OSError as exc:
            log.error("trace %s: write failed (%s); tracing stops", self.path, exc)
            self._file = None


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
