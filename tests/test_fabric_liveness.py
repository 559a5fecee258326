"""The coordinator's side of the fabric's liveness, driven by hand (no daemons, no sockets):
stall rows warned once, sent to every member, and a stall too long shuts the fabric down."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

from commd.fabric.member import FabricMember
from commd.protocol.fabric import TO_MEMBER, CoordinatorHeartbeat, Ready, Shutdown, batch, decode_batch
from commd.scheduler.config import SchedulerConfig


class _Lane:
    def can_run(self, primitive: str, dtype: str, reduce_op: Any, nodes: Any) -> None:
        return None


class _Node:
    """The node services the coordinator's member needs here (records shutdowns)."""

    def __init__(self) -> None:
        self.shutdowns: list[str] = []

    def shutdown(self, reason: str) -> None:
        self.shutdowns.append(reason)

    def fail_seq(self, group: str, seq: int, code: str, message: str) -> None:
        raise AssertionError(f"no bridged ring here, yet op #{seq} of group {group!r} failed on one: {message}")

    def flush(self) -> None:
        pass


class _Link:
    """The control link to node 1: keeps the receive callback and what is sent to node 1."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def attach(self, loop: Any, on_message: Any, on_close: Any) -> None:
        self.deliver = on_message

    def send(self, frame: dict[str, Any]) -> None:
        messages, problems = decode_batch(frame, TO_MEMBER)
        assert not problems
        self.sent.extend(messages)


def _coordinator(config: SchedulerConfig) -> tuple[FabricMember, _Node, _Link]:
    """Node 0 of a two-node fabric, with node 1's report of an all-reduce node 0 never reports."""
    nodes = [SimpleNamespace(rank=r, name=f"n{r}", ip="127.0.0.1") for r in range(2)]
    link = _Link()
    fabric = SimpleNamespace(nnodes=2, node_rank=0, is_coordinator=True, config=config,
                             lanes={"tcp": _Lane(), "gloo": _Lane()}, nodes=nodes, links={1: link}, tree_links={}, catalog=None)
    node = _Node()
    member = FabricMember(node, fabric, peer_timeout=600.0)  # type: ignore[arg-type]
    member.start(loop=None)
    report = {"t": "ready", "g": "g", "s": 0, "k": "allreduce",
              "sig": {"lane": "", "dtype": "float32", "count": 4, "reduce_op": "sum", "scale": 1.0},
              "ranks": [0, 1, 2, 3], "pl": [0, 0, 1, 1], "n": [0, 1], "mine": [2, 3], "nb": 16, "to": 300.0}
    link.deliver(batch([Ready.from_wire(report)]))
    return member, node, link


def test_the_coordinator_warns_of_a_stall_once_and_sends_the_rows_to_every_member(caplog) -> None:
    member, node, link = _coordinator(SchedulerConfig(stall_warning_s=1.0))
    first_at = member.coordinator.pending[("g", 0)].first_at
    with caplog.at_level(logging.WARNING, logger="commd.fabric"):
        member.tick(first_at + 5)
        member.tick(first_at + 6)
    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stalled:")]
    assert warnings == ["stalled: allreduce #0 on group 'g' has waited 5s for ranks [0, 1] (nodes [0])"], caplog.text
    beats = [m for m in link.sent if type(m) is CoordinatorHeartbeat]
    assert len(beats) == 2 and beats[0].stalls[0]["missing_nodes"] == [0], link.sent
    assert member.fabric_stalls == beats[1].stalls and member.fabric_stalls[0]["waiting_s"] == 6.0
    assert node.shutdowns == []


def test_a_stall_past_the_shutdown_limit_shuts_every_node_down() -> None:
    member, node, link = _coordinator(SchedulerConfig(stall_warning_s=1.0, stall_shutdown_s=3.0))
    member.tick(member.coordinator.pending[("g", 0)].first_at + 5)
    why = "allreduce #0 on group 'g' stalled for 5s waiting for ranks [0, 1]"
    assert [m for m in link.sent if type(m) is Shutdown] == [Shutdown(why)], link.sent
    assert not [m for m in link.sent if type(m) is CoordinatorHeartbeat]
    assert node.shutdowns == [why]


class _Completions:
    """The node services LaneRunner.done needs: records each completion."""

    def __init__(self) -> None:
        self.completed: list[tuple[str | None, str]] = []

    def complete(self, op: Any, error: str | None, code: str) -> None:
        self.completed.append((error, code))

    def flush(self) -> None:
        pass


def test_a_lane_timeout_among_nodes_declared_dead_completes_as_that_death_and_nothing_else_changes() -> None:
    """A lane that cannot be told of a verdict (gloo, MPI) waits out its timeout on a silent node;
    the op must then fail as the node's death (what commd.ft recovers from), not as a timeout."""
    from commd.core.ops import ReadyOp
    from commd.fabric.runner import LaneRunner
    from commd.protocol import schema as s

    verdicts = {1: "node 1 (n1) has not been heard from for 10s"}
    node = _Completions()
    runner = LaneRunner(node, None, 10.0, lambda nodes: next((verdicts[n] for n in nodes if n in verdicts), None))
    op = ReadyOp("allreduce", "g0.0", 7, [], 0.0, nbytes=0)
    runner.done(op, "gloo allreduce timed out after 60 s", s.E_TIMEOUT, (0, 1))
    runner.done(op, "gloo allreduce timed out after 60 s", s.E_TIMEOUT, (0, 2))  # no verdict on its nodes
    runner.done(op, "stream out of step", s.E_INTERNAL, (0, 1))  # not a timeout: as it is
    runner.done(op, None, s.E_INTERNAL, (0, 1))  # success
    assert node.completed == [
        ("allreduce #7 on group 'g0.0' failed between nodes: gloo allreduce timed out after 60 s "
         "(node 1 (n1) has not been heard from for 10s)", s.E_PEER_DIED),
        ("allreduce #7 on group 'g0.0' failed between nodes: gloo allreduce timed out after 60 s", s.E_TIMEOUT),
        ("allreduce #7 on group 'g0.0' failed between nodes: stream out of step", s.E_INTERNAL),
        (None, s.E_INTERNAL),
    ]
