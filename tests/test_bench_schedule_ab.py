"""benchmarks/schedule_ab.py --trace: the daemons' phases per op, read back from a node's trace.

The trace here is written in the daemon's format (``commd/observe/trace.py``: per op a ``b``/``e``
pair named after the op with its args, and one pair per phase, all of one id) with known phase
lengths, so the medians are known without the code under test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import schedule_ab as bench  # noqa: E402


def op_events(op_id: int, kind: str, nbytes: int, start: float, phases: list[tuple[str, float]]) -> list[dict]:
    """One op's events as the daemon writes them: phases back to back from ``start`` (us)."""
    head = {"cat": "commd", "id": op_id, "pid": 0, "tid": 1}
    args = {"kind": kind, "group": "g0.0", "seq": op_id, "bytes": nbytes, "lane": "tcp", "ranks": [0, 1], "node": 0}
    out = [{**head, "ph": "b", "name": f"{kind} #{op_id}", "ts": start, "args": args}]
    at = start
    for name, length in phases:
        out += [{**head, "ph": "b", "name": name, "ts": at}, {**head, "ph": "e", "name": name, "ts": at + length}]
        at += length
    return out + [{**head, "ph": "e", "name": f"{kind} #{op_id}", "ts": at}]


def write_trace(path: Path, finished: bool) -> None:
    events: list[dict] = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "node 0"}}]
    # 2 warm-up ops of the size (longer lanes), then 3 timed ones, then ops the medians must skip
    lanes = [900.0, 800.0, 100.0, 300.0, 200.0]
    for i, lane in enumerate(lanes):
        phases = [("submit", 10.0 + i), ("schedule", 5.0), ("queue", 7.0), ("lane", lane), ("reply", 3.0)]
        events += op_events(i + 1, "allreduce", 4096, 1000.0 * i, phases)
    events += op_events(9, "allreduce", 8192, 9000.0, [("submit", 1.0), ("lane", 5000.0)])  # another size
    events += op_events(10, "broadcast", 4096, 10000.0, [("submit", 1.0), ("lane", 7000.0)])  # another kind
    events.append({"ph": "i", "s": "p", "cat": "commd", "name": "rank gone", "pid": 0, "tid": 2, "ts": 1.0})
    text = "[\n" + ",\n".join(json.dumps(e) for e in events)
    if finished:
        path.write_text(text + "\n]\n")
    else:  # the daemon still running: only its hidden partial file, which ends with a comma at most
        path.with_name(f".{path.name}.partial").write_text(text + ",\n")


@pytest.mark.parametrize("finished", [True, False])
def test_phase_medians_take_the_timed_ops_of_the_size_only(tmp_path: Path, finished: bool) -> None:
    trace = tmp_path / "trace.json"
    write_trace(tmp_path / "trace.node0.json", finished)
    medians = bench.phase_medians(trace, 0, 4096, iters=3)
    assert medians == {"submit": 13.0, "schedule": 5.0, "queue": 7.0, "lane": 200.0, "reply": 3.0, "ops": 3}
    every = bench.phase_medians(trace, 0, 4096, iters=5)
    assert every["lane"] == 300.0 and every["submit"] == 12.0 and every["ops"] == 5


def test_a_phase_only_some_ops_had_is_the_median_over_those(tmp_path: Path) -> None:
    events = op_events(1, "allreduce", 64, 0.0, [("submit", 4.0), ("negotiate", 500.0), ("lane", 2.0)])
    events += op_events(2, "allreduce", 64, 10.0, [("submit", 6.0), ("schedule", 20.0), ("lane", 4.0)])
    events += op_events(3, "allreduce", 64, 20.0, [("submit", 8.0), ("schedule", 40.0), ("lane", 6.0)])
    (tmp_path / "t.node1.json").write_text(json.dumps(events))
    medians = bench.phase_medians(tmp_path / "t.json", 1, 64, iters=10)
    assert medians == {"submit": 6.0, "schedule": 30.0, "negotiate": 500.0, "lane": 4.0, "ops": 3}
