"""commd.ft's recoveries as the daemon shows them: ``Client.report_membership`` → ``commd status``, metrics, trace.

Only the guard (commd/ft.py) knows that its survivors rebuilt their group, and how long that took; it
reports each recovery to its node daemon on the op channel (a ``membership`` message, no reply).  These
tests send the reports from in-process clients of a real daemon, as the guards of survivors would: every
survivor reports the same recovery and the daemon keeps one entry for it.  A report the daemon would
refuse is refused with an error naming the field, and the daemon goes on serving.
"""

from __future__ import annotations

import json
import logging
import math
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import wait_until
from prometheus_client.parser import text_string_to_metric_families

from commd.cli.status import format_status
from commd.client import ops
from commd.client.status import query_status, send_trace_control
from commd.protocol import schema as s

WORLD = 3


def status_of(daemon: Any) -> dict[str, Any]:
    return query_status(daemon.paths, timeout=5.0)


def reported(daemon: Any, event: str, epoch: int, ranks: list[int]) -> dict[str, Any] | None:
    """The status entry of (event, epoch) once every rank of ``ranks`` reported it."""
    for entry in status_of(daemon)["membership"]["recoveries"]:
        if entry["event"] == event and entry["epoch"] == epoch and entry["ranks"] == ranks:
            return entry
    return None


def metric_values(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=5.0) as reply:
        text = reply.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


@pytest.mark.timeout(30)
def test_every_survivors_report_of_a_recovery_makes_one_entry_in_status_text_and_metrics(start_daemon,
                                                                                          connect) -> None:
    daemon = start_daemon(extra=["--metrics-port", "0"]).wait_ready()
    clients = [connect(rank, WORLD + 1) for rank in range(WORLD + 1)]
    clients[WORLD].close()  # rank 3 leaves: the daemon counts it gone (membership epoch 1)
    for rank, seconds in zip(range(WORLD), (0.1, 0.21, 0.15), strict=True):
        assert clients[rank].report_membership("recovered", epoch=1, gone=[3], members=(0, 1, 2), seconds=seconds,
                                               step=3)
    entry = wait_until(lambda: reported(daemon, "recovered", 1, [0, 1, 2]), 5, "the three reports, merged")
    assert entry["gone"] == [3] and entry["members"] == [0, 1, 2] and entry["step"] == 3
    assert entry["seconds"] == pytest.approx(0.21)  # the slowest survivor's
    # a replacement taken back in, then a guard that gave up: one entry each, the last recovery unchanged by it
    for rank in range(WORLD):
        clients[rank].report_membership("joined", epoch=2, gone=[], members=[0, 1, 2, 3], seconds=0.5, step=7)
    wait_until(lambda: reported(daemon, "joined", 2, [0, 1, 2]), 5, "the join")
    clients[0].report_membership("gave_up", epoch=3, gone=[1, 2], members=[0], seconds=2.0, step=9,
                                 why="1 of 4 ranks survive (ranks [0]); the guard needs at least 2")
    wait_until(lambda: reported(daemon, "gave_up", 3, [0]), 5, "the giving up")

    status = status_of(daemon)
    membership = status["membership"]
    assert [e["event"] for e in membership["recoveries"]] == ["recovered", "joined", "gave_up"]
    assert membership["recovery_counts"] == {"recovered": 1, "joined": 1, "gave_up": 1}
    assert membership["last_recovery_s"] == pytest.approx(0.5)
    json.dumps(status)  # what `commd status --json` prints
    text = format_status(status)
    assert "commd.ft: 1 recovered, 1 joined, 1 gave up; last recovery 0.50 s" in text, text
    assert "recovery epoch 1 at step 3: ranks [3] gone, 3 ranks go on, 0.21 s (reported by ranks 0,1,2)" in text
    assert "rejoin epoch 2 at step 7: 4 ranks again, 0.50 s (reported by ranks 0,1,2)" in text
    assert ("GAVE UP epoch 3 at step 9: ranks [1, 2] gone, 1 left, 2.00 s: 1 of 4 ranks survive (ranks [0]); "
            "the guard needs at least 2 (reported by ranks 0)") in text

    values = metric_values(status["observe"]["metrics_url"])
    for event in s.FT_EVENTS:
        assert values[("commd_ft_recoveries_total", (("event", event),))] == 1, event
    assert values[("commd_ft_last_recovery_seconds", ())] == pytest.approx(0.5)
    assert values[("commd_membership_epoch", ())] == 1


@pytest.mark.timeout(30)
def test_a_rank_reporting_a_recovery_again_starts_a_new_entry_and_no_report_no_gauge(start_daemon, connect) -> None:
    """The same rank reporting (event, epoch) twice is a later job's guard, not a second survivor; with no
    daemon to take it, a report is dropped (False), not raised."""
    daemon = start_daemon(extra=["--metrics-port", "0"]).wait_ready()
    client = connect(0, WORLD)
    status = status_of(daemon)
    assert status["membership"]["recoveries"] == [] and status["membership"]["last_recovery_s"] is None
    values = metric_values(status["observe"]["metrics_url"])
    assert ("commd_ft_last_recovery_seconds", ()) not in values
    assert values[("commd_ft_recoveries_total", (("event", "recovered"),))] == 0
    for seconds in (1.0, 3):
        client.report_membership("recovered", epoch=1, gone=[2], members=[0, 1], seconds=seconds, step=0,
                                 group="world")
    wait_until(lambda: len(status_of(daemon)["membership"]["recoveries"]) == 2, 5, "two entries")
    membership = status_of(daemon)["membership"]
    assert membership["recovery_counts"]["recovered"] == 2 and membership["last_recovery_s"] == 3.0
    assert "recovery epoch 1 of group world at step 0" in format_status(status_of(daemon))
    daemon.stop()  # a report that cannot reach the daemon is given up, logged: it never fails a training step
    assert client.report_membership("gave_up", epoch=2, gone=[1], members=[0], seconds=0.0, step=1) is False


#: Membership reports the daemon must refuse (from rank 0 of a 3-rank job), and what its error says.
GOOD = {"t": s.MEMBERSHIP, "event": "recovered", "epoch": 1, "step": 4, "gone": [2], "members": [0, 1],
        "seconds": 0.3}
BAD: list[tuple[dict[str, Any], str]] = [
    ({"event": "exploded"}, "field 'event' must be one of ['recovered', 'joined', 'gave_up']"),
    ({"event": 7}, "field 'event' must be str"),
    ({"epoch": None}, "missing field 'epoch'"),
    ({"epoch": -1}, "field 'epoch'=-1 outside"),
    ({"epoch": True}, "field 'epoch' must be an integer, got bool"),
    ({"step": "4"}, "field 'step' must be int"),
    ({"step": -2}, "field 'step'=-2 outside"),
    ({"seconds": math.nan}, "field 'seconds' must be a finite number"),
    ({"seconds": math.inf}, "field 'seconds' must be a finite number"),
    ({"seconds": -0.5}, "field 'seconds' must be a finite number"),
    ({"seconds": "fast"}, "field 'seconds' must be int or float"),
    ({"gone": 2}, "field 'gone' must be list"),
    ({"gone": [5]}, "field 'gone' must list ranks: integers in [0, 3)"),
    ({"gone": ["2"]}, "field 'gone' must list ranks"),
    ({"gone": [2] * 4}, "field 'gone' lists 4 ranks, more than the job's 3"),
    ({"members": [0, 0]}, "field 'members' lists a rank twice"),
    ({"gone": [1, 2], "members": [0, 1]}, "ranks [1] are listed both gone and members"),
    ({"members": [1]}, "a 'recovered' report comes from a member: rank 0 is not in 'members' [1]"),
    ({"gone": []}, "a 'recovered' report names the ranks gone"),
    ({"event": "joined"}, "a 'joined' report lists no rank gone"),
    ({"group": "no spaces allowed"}, "group name 'no spaces allowed' is not valid"),
    ({"group": "g" * 300}, "field 'group' is longer than 256 characters"),
]


@pytest.mark.timeout(30)
def test_bad_membership_reports_are_refused_naming_the_field_and_the_daemon_keeps_serving(
        start_daemon, connect, caplog: pytest.LogCaptureFixture) -> None:
    daemon = start_daemon().wait_ready()
    client = connect(0, WORLD)
    for change, expected in BAD:  # the client refuses them before sending (the same check)
        fields = {k: v for k, v in {**GOOD, **change}.items() if k != "t" and v is not None}
        event = fields.pop("event")
        with pytest.raises((ValueError, TypeError)):  # TypeError: a keyword missing
            client.report_membership(event, **fields)
            pytest.fail(f"the client sent a report with {change} ({expected})")
    with client._send_lock:  # now past the client's check, as a client in another language might
        for change, _expected in BAD:
            message = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
            client._send_op(s.encode(message), time.monotonic() + 5)
    with caplog.at_level(logging.ERROR, logger="commd.client"):  # each refusal answered (an ERROR, id -1)
        wait_until(lambda: client.pump(0.05) or sum("commd daemon: " in r.message for r in caplog.records)
                   >= len(BAD), 10, "an error reply for every bad report")
    answers = [r.message for r in caplog.records if "commd daemon: " in r.message]
    errors = [e["message"] for e in status_of(daemon)["last_errors"]]
    for (_change, expected), answer in zip(BAD, answers, strict=True):
        assert expected in answer, (expected, answer)
    for _change, expected in BAD[-len(errors):]:  # the daemon keeps its last 20
        assert any(expected in e for e in errors), (expected, errors)
    # nothing kept, and the daemon goes on: this client's next report and ops are served
    assert status_of(daemon)["membership"]["recoveries"] == []
    assert client.report_membership("recovered", epoch=1, gone=[2], members=[0, 1], seconds=0.3, step=4)
    wait_until(lambda: reported(daemon, "recovered", 1, [0]), 5, "a good report after the bad ones")
    client.register_group("alone", [0])
    tensor = torch.ones(4)
    ops.all_reduce(client, tensor, group="alone").wait(10)
    assert tensor.tolist() == [1.0] * 4


@pytest.mark.timeout(30)
def test_the_trace_marks_a_rank_gone_and_the_recovery_reported(start_daemon, connect, tmp_path: Path) -> None:
    trace = tmp_path / "ft.json"
    daemon = start_daemon(extra=["--trace", str(trace)]).wait_ready()
    clients = [connect(rank, WORLD) for rank in range(WORLD)]
    clients[2].close()
    for rank in (0, 1):  # one after the other: the mark names the first
        clients[rank].report_membership("recovered", epoch=1, gone=[2], members=[0, 1], seconds=0.25, step=5)
        wait_until(lambda rank=rank: reported(daemon, "recovered", 1, list(range(rank + 1))), 5, "the report")
    send_trace_control(daemon.paths, "stop", None)
    events = json.loads(trace.read_text())
    marks = [e for e in events if e.get("ph") == "i"]
    assert [m["name"] for m in marks] == ["rank 2 gone", "ft recovered epoch 1"], marks  # one mark per recovery
    gone, recovered = marks
    assert gone["args"]["rank"] == 2 and gone["args"]["epoch"] == 1
    assert recovered["args"] == {"event": "recovered", "epoch": 1, "step": 5, "gone": [2], "members": [0, 1],
                                 "seconds": 0.25, "reported_by": 0}
    assert recovered["s"] == "p" and recovered["ts"] >= gone["ts"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert tracks[recovered["tid"]] == "membership"
