"""The fabric's typed messages: the exact bytes on the control channel, decoding and its validation.

Every expected map below is written out by hand in the form the fabric has always sent
(keys, their order, which optional keys are left out, value types), so a change to any
message's wire form fails here before it can split a fabric of mixed builds.
"""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest

from commd.fabric.channel import frame
from commd.fabric.member import FabricMember
from commd.protocol import schema as s
from commd.protocol.fabric import (
    TO_COORDINATOR,
    TO_MEMBER,
    CoordinatorHeartbeat,
    Early,
    FabricMessageError,
    Fail,
    Go,
    Heartbeat,
    Leaving,
    NodeDead,
    OpPattern,
    P2pFail,
    P2pGo,
    P2pMatch,
    P2pSend,
    RankDied,
    Ready,
    ReadySet,
    RemoteSend,
    RingPart,
    Routed,
    Schedule,
    ScheduleEnded,
    ScheduleSlot,
    SendFailed,
    Shutdown,
    StopSchedule,
    Trace,
    Via,
    batch,
    decode,
    decode_batch,
)

SIG = {"lane": "", "dtype": "float32", "count": 4, "reduce_op": "sum", "scale": 1.0}
PATTERN = OpPattern(kind="allreduce", signature=SIG, ranks=[0, 1, 2, 3], placement=[0, 0, 1, 1], nodes=[0, 1],
                    mine=[0, 1], nbytes=16, timeout=30.0)
SPLITS = [[0, [1, 1], [1, 1]], [1, [1, 1], [1, 1]]]
A2A = OpPattern(kind="alltoall", signature={"dtype": "int64", "count": 2}, ranks=[0, 1, 2, 3],
                placement=[0, 0, 1, 1], nodes=[0, 1], mine=[0, 1], nbytes=16, timeout=5.5, alltoall_splits=SPLITS)
SEND = P2pSend(key=9, dst_node=1, group="pp", src=0, dst=3, tag=7, dtype="bfloat16", count=10, nbytes=20,
               timeout=30.0, lane_hint=None)
ROW = {"group": "g", "seq": 4, "kind": "allreduce", "waiting_s": 12.5, "missing_nodes": [1], "missing_ranks": [2, 3]}

# (message, the map the fabric sends for it, the vocabulary of its receiver)
CASES: list[tuple[Any, dict[str, Any], dict[str, Any]]] = [
    # ---- member -> coordinator
    (Ready("g", 3, pattern=PATTERN),
     {"t": "ready", "g": "g", "s": 3, "k": "allreduce", "sig": SIG, "ranks": [0, 1, 2, 3], "pl": [0, 0, 1, 1],
      "n": [0, 1], "mine": [0, 1], "nb": 16, "to": 30.0}, TO_COORDINATOR),
    (Ready("a", 0, pattern=A2A, contribution=b"\x01\x02", no_fusion=True),
     {"t": "ready", "g": "a", "s": 0, "k": "alltoall", "sig": {"dtype": "int64", "count": 2}, "ranks": [0, 1, 2, 3],
      "pl": [0, 0, 1, 1], "n": [0, 1], "mine": [0, 1], "nb": 16, "to": 5.5, "a2a": SPLITS, "d": b"\x01\x02",
      "nf": 1}, TO_COORDINATOR),
    (Ready("g", 4, cache_id=2), {"t": "ready", "g": "g", "s": 4, "c": 2}, TO_COORDINATOR),
    (Ready("g", 5, cache_id=2, contribution=b"\x00" * 8, no_fusion=True),
     {"t": "ready", "g": "g", "s": 5, "c": 2, "d": b"\x00" * 8, "nf": 1}, TO_COORDINATOR),
    (SEND, {"t": "p2p_send", "key": 9, "dn": 1, "g": "pp", "src": 0, "dst": 3, "tag": 7, "dtype": "bfloat16",
            "count": 10, "nb": 20, "to": 30.0, "h": None}, TO_COORDINATOR),
    (P2pSend(1, 2, "g", 1, 0, 0, "uint8", 4, 4, 2.0, "tcp"),
     {"t": "p2p_send", "key": 1, "dn": 2, "g": "g", "src": 1, "dst": 0, "tag": 0, "dtype": "uint8", "count": 4,
      "nb": 4, "to": 2.0, "h": "tcp"}, TO_COORDINATOR),
    (P2pMatch(sender_node=0, key=9), {"t": "p2p_match", "sn": 0, "key": 9}, TO_COORDINATOR),
    (SendFailed(sender_node=0, key=9, code=s.E_TIMEOUT, message="timed out"),
     {"t": "p2p_fail", "sn": 0, "key": 9, "code": "timeout", "m": "timed out"}, TO_COORDINATOR),
    (Heartbeat([("g", 3, [1, 2])]), {"t": "hb", "stalled": [["g", 3, [1, 2]]]}, TO_COORDINATOR),
    (Heartbeat([]), {"t": "hb", "stalled": []}, TO_COORDINATOR),
    (RankDied(5, "exited"), {"t": "rank_died", "rank": 5, "why": "exited"}, TO_COORDINATOR),
    (Leaving("shut down"), {"t": "leaving", "why": "shut down"}, TO_COORDINATOR),
    # ---- coordinator -> member
    (Go("g", 3, 17, "tcp"), {"t": "go", "g": "g", "s": 3, "o": 17, "l": "tcp"}, TO_MEMBER),
    (Go("g", 3, 17, "gloo", cache_id=4, result=b"\x05" * 4, fused_with=15),
     {"t": "go", "g": "g", "s": 3, "o": 17, "l": "gloo", "c": 4, "r": b"\x05" * 4, "fz": 15}, TO_MEMBER),
    (Fail("g", 3, s.E_MISMATCH, "mismatched"), {"t": "fail", "g": "g", "s": 3, "code": "mismatch", "m": "mismatched"},
     TO_MEMBER),
    (Early("g", 3, 4, b"\x05" * 8), {"t": "early", "g": "g", "s": 3, "c": 4, "d": b"\x05" * 8}, TO_MEMBER),
    (RingPart("g", 7, 12, 1, [0], 1, 0, 2, b"\x00" * 8),
     {"t": "ring", "g": "g", "s": 7, "i": 12, "sn": 1, "to": [0], "dt": 1, "o": 0, "n": 2, "d": b"\x00" * 8},
     TO_COORDINATOR),
    (RingPart("g", 8, -1, 0, [1, 2], 0, 0, 0, None, "diverged", "why"),
     {"t": "ring", "g": "g", "s": 8, "i": -1, "sn": 0, "to": [1, 2], "dt": 0, "o": 0, "n": 0, "d": None,
      "e": "diverged", "m": "why"}, TO_MEMBER),
    (Schedule(3, "dp", [0, 1], 41, 17, [ScheduleSlot(5, "tcp"), ScheduleSlot(6, "tcp", "ring", "a" * 64, None),
                                         ScheduleSlot(7, "tcp", None, None, "blosc-lz4", True)]),
     {"t": "sched", "e": 3, "g": "dp", "n": [0, 1], "o": 41, "s": 17,
      "sl": [[5, "tcp", None, None, None, False], [6, "tcp", "ring", "a" * 64, None, False],
             [7, "tcp", None, None, "blosc-lz4", True]]},
     TO_MEMBER),
    (StopSchedule(3), {"t": "sched_stop", "e": 3}, TO_MEMBER),
    (StopSchedule(4), {"t": "sched_stop", "e": 4}, TO_COORDINATOR),
    (Ready("g", 3, None, 7, None, False, 1.25), {"t": "ready", "g": "g", "s": 3, "c": 7, "w": 1.25}, TO_COORDINATOR),
    (ScheduleEnded(3, 52), {"t": "sched_end", "e": 3, "o": 52}, TO_COORDINATOR),
    (ReadySet("g", 4, 2, ((0, 3), (5, 6))), {"t": "ready_set", "g": "g", "s": 4, "c": 2, "r": [[0, 3], [5, 6]]},
     TO_COORDINATOR),
    (Via(5, [Ready("g", 4, cache_id=2), Heartbeat([])]),
     {"t": "via", "n": 5, "items": [{"t": "ready", "g": "g", "s": 4, "c": 2}, {"t": "hb", "stalled": []}]},
     TO_COORDINATOR),
    (Routed(((1, 4),), [{"t": "go", "g": "g", "s": 3, "o": 17, "l": "tcp"}]),
     {"t": "to", "r": [[1, 4]], "items": [{"t": "go", "g": "g", "s": 3, "o": 17, "l": "tcp"}]}, TO_MEMBER),
    (RemoteSend(SEND, sender_node=0),
     {"t": "remote_send", "key": 9, "dn": 1, "g": "pp", "src": 0, "dst": 3, "tag": 7, "dtype": "bfloat16",
      "count": 10, "nb": 20, "to": 30.0, "h": None, "sn": 0}, TO_MEMBER),
    (P2pGo(9, sender_node=None, order=18, lane="tcp", role="send", peer=1),
     {"t": "p2p_go", "key": 9, "o": 18, "l": "tcp", "role": "send", "peer": 1}, TO_MEMBER),
    (P2pGo(9, sender_node=0, order=18, lane="tcp", role="recv", peer=0),
     {"t": "p2p_go", "key": 9, "sn": 0, "o": 18, "l": "tcp", "role": "recv", "peer": 0}, TO_MEMBER),
    (P2pFail(9, None, s.E_PEER_DIED, "gone"), {"t": "p2p_fail", "key": 9, "code": "peer_died", "m": "gone"},
     TO_MEMBER),
    (P2pFail(9, 0, s.E_PROTOCOL, "no lane"), {"t": "p2p_fail", "key": 9, "sn": 0, "code": "protocol", "m": "no lane"},
     TO_MEMBER),
    (NodeDead(2, "stopped answering"), {"t": "node_dead", "node": 2, "why": "stopped answering"}, TO_MEMBER),
    (RankDied(5, "exited"), {"t": "rank_died", "rank": 5, "why": "exited"}, TO_MEMBER),
    (CoordinatorHeartbeat([ROW]), {"t": "hb", "stalls": [ROW]}, TO_MEMBER),
    (Shutdown("stalled for 60s"), {"t": "shutdown", "why": "stalled for 60s"}, TO_MEMBER),
    (Leaving("shut down"), {"t": "leaving", "why": "shut down"}, TO_MEMBER),
    (Trace("start", "/tmp/t.json"), {"t": "trace", "a": "start", "p": "/tmp/t.json"}, TO_MEMBER),
    (Trace("stop", None), {"t": "trace", "a": "stop", "p": None}, TO_MEMBER),
]
IDS = [f"{i}-{expected['t']}" for i, (_, expected, _) in enumerate(CASES)]


def _packed(item: dict[str, Any]) -> bytes:
    return msgpack.packb(item, use_bin_type=True)


@pytest.mark.parametrize(("message", "expected", "vocabulary"), CASES, ids=IDS)
def test_to_wire_is_byte_for_byte_the_fabric_map(message, expected, vocabulary) -> None:
    assert list(message.to_wire()) == list(expected)  # key order (msgpack keeps it)
    assert _packed(message.to_wire()) == _packed(expected)


@pytest.mark.parametrize(("message", "expected", "vocabulary"), CASES, ids=IDS)
def test_received_map_decodes_to_the_message(message, expected, vocabulary) -> None:
    received = msgpack.unpackb(_packed(expected), raw=False, strict_map_key=True)
    assert decode(received, vocabulary) == message
    assert decode_batch({"t": "batch", "items": [received]}, vocabulary) == ([message], [])
    checked = getattr(type(message), "checked", None)  # the field-by-field path of a message with a fast path
    if checked is not None:
        assert checked(received) == message


def test_every_wire_type_is_pinned() -> None:
    pinned = {(expected["t"], vocabulary is TO_MEMBER) for _, expected, vocabulary in CASES}
    assert pinned == {(t, False) for t in TO_COORDINATOR} | {(t, True) for t in TO_MEMBER}
    assert len({t for t, _ in pinned}) == 22  # one vocabulary of 22 types, two directions


def test_a_frame_holds_the_same_bytes_as_the_batch_map() -> None:
    messages = [Go("g", 1, 1, "tcp"), Go("g", 2, 2, "tcp", fused_with=1), Fail("h", 0, "timeout", "late")]
    expected = {"t": "batch", "items": [{"t": "go", "g": "g", "s": 1, "o": 1, "l": "tcp"},
                                        {"t": "go", "g": "g", "s": 2, "o": 2, "l": "tcp", "fz": 1},
                                        {"t": "fail", "g": "h", "s": 0, "code": "timeout", "m": "late"}]}
    assert frame(batch(messages)) == frame(expected)
    body = frame(batch(messages))[4:]
    assert list(msgpack.unpackb(body, raw=False)) == ["t", "items", "v"]  # the version goes last


@pytest.mark.parametrize(
    ("vocabulary", "item", "needle"),
    [
        (TO_MEMBER, {"t": "go", "g": "g", "s": 1, "o": "7", "l": "tcp"}, "'go': field 'o' (order) must be an integer"),
        (TO_MEMBER, {"t": "go", "g": "g", "s": 1, "o": 7}, "'go': field 'l' (lane) is missing"),
        (TO_MEMBER, {"t": "go", "g": "g", "s": 1, "o": 7, "l": "tcp", "r": "text"}, "field 'r' (result) must be bytes"),
        (TO_MEMBER, {"t": "fail", "g": "g", "s": True, "code": "x", "m": "y"}, "'fail': field 's' (seq)"),
        (TO_MEMBER, {"t": "p2p_go", "key": 1, "o": 2, "l": "tcp", "role": "both", "peer": 0},
         "'p2p_go': field 'role' (role) must be 'send' or 'recv'"),
        (TO_MEMBER, {"t": "p2p_go", "key": 1, "o": 2, "l": "tcp", "role": "recv", "peer": 0},
         "'p2p_go': field 'sn' (sender's node) is missing"),
        (TO_MEMBER, {"t": "remote_send", "key": 9, "dn": 1, "g": "pp", "src": 0, "dst": 3, "tag": 7,
                     "dtype": "float32", "count": 10, "nb": 20, "to": 30.0, "h": None},
         "'remote_send': field 'sn' (sender's node) is missing"),
        (TO_MEMBER, {"t": "hb", "stalls": [["g", 1]]}, "'hb': field 'stalls' (stall rows) must be a list of maps"),
        (TO_MEMBER, {"t": "trace", "a": 1, "p": None}, "'trace': field 'a' (action)"),
        (TO_MEMBER, {"t": "ready", "g": "g", "s": 1, "c": 1}, "unknown type 'ready'"),  # wrong direction
        (TO_MEMBER, ["go"], "fabric item must be a map"),
        (TO_MEMBER, {"t": "early", "g": "g", "s": 1, "c": 2}, "'early': field 'd' (contribution) must be bytes"),
        (TO_MEMBER, {"t": "early", "g": "g", "s": 1, "c": None, "d": b"x"}, "'early': field 'c' (cache id)"),
        (TO_COORDINATOR, {"t": "ready", "g": "g", "s": 1, "k": "allreduce", "sig": SIG, "ranks": [0, 1],
                          "pl": [0, 1], "n": [0, 1], "mine": [0], "nb": 4},
         "'ready': field 'to' (timeout) is missing"),
        (TO_COORDINATOR, {"t": "ready", "g": "g", "s": 1, "k": "allreduce", "sig": SIG, "ranks": [0, 1],
                          "pl": [0], "n": [0, 1], "mine": [0], "nb": 4, "to": 1.0},
         "'ready': field 'pl' (placement) must be one node per rank (2)"),
        (TO_COORDINATOR, {"t": "ready", "g": "g", "s": 1, "k": "alltoall", "sig": {}, "ranks": [0, 1],
                          "pl": [0, 1], "n": [0, 1], "mine": [0], "nb": 4, "to": 1.0},
         "'ready': field 'a2a' (alltoall splits)"),
        (TO_COORDINATOR, {"t": "ready", "g": "g", "s": 1, "c": "2"}, "'ready': field 'c' (cache id)"),
        (TO_COORDINATOR, {"t": "ready", "g": "g", "s": 1, "c": 2, "d": [1]}, "'ready': field 'd' (contribution)"),
        (TO_COORDINATOR, {"t": "hb", "stalled": [["g", "3", []]]}, "'hb': field 'stalled'"),
        (TO_COORDINATOR, {"t": "p2p_send", "key": 1, "dn": 1, "g": "g", "src": 0, "dst": 1, "tag": 0,
                          "dtype": "uint8", "count": 1, "nb": 1, "to": "soon", "h": None},
         "'p2p_send': field 'to' (timeout) must be a number"),
        (TO_MEMBER, {"t": "sched", "e": 1, "g": "g", "n": [0, 1], "o": 1, "s": 1, "sl": []},
         "'sched': field 'sl' (slots) must be a list of 1 to 1024 slots"),
        (TO_MEMBER, {"t": "sched", "e": 1, "g": "g", "n": [1, 0], "o": 1, "s": 1, "sl": [[1, "tcp", None, None, None, False]]},
         "'sched': field 'n' (nodes) must be two or more node ranks, ascending"),
        (TO_MEMBER, {"t": "sched", "e": 1, "g": "g", "n": [0, 1], "o": 1, "s": 1, "sl": [[1, "tcp", "x", None, None, False]]},
         "'sched': field 'sl' (slots) must be a program name with its sha256"),
        (TO_MEMBER, {"t": "sched", "e": 1, "g": "g", "n": [0, 1], "o": 1, "s": 1, "sl": [["1", "tcp", None, None, None, False]]},
         "'sched': field 'sl' (slots) must be a list of [cache id, lane, program, its sha256, codec, gather]"),
        (TO_MEMBER, {"t": "sched", "e": 1, "g": "g", "n": [0, 1], "o": 1, "s": 1, "sl": [[1, "tcp", None, None, None, 1]]},
         "'sched': field 'sl' (slots) must be a list of [cache id, lane, program, its sha256, codec, gather]"),
        (TO_MEMBER, {"t": "sched_stop"}, "'sched_stop': field 'e' (epoch) is missing"),
        (TO_COORDINATOR, {"t": "sched_end", "e": 1, "o": "2"}, "'sched_end': field 'o' (order) must be an integer"),
        (TO_COORDINATOR, {"t": "ready_set", "g": "g", "s": 1, "c": 2, "r": [[3, 3]]}, "'r' (node ranges) must be"),
        (TO_COORDINATOR, {"t": "ready_set", "g": "g", "s": 1, "c": 2, "r": [[0, 2], [1, 4]]}, "disjoint"),
        (TO_COORDINATOR, {"t": "ready_set", "g": "g", "s": 1, "c": 2, "r": []}, "'r' (node ranges)"),
        (TO_COORDINATOR, {"t": "via", "n": "x", "items": []}, "'via': field 'n' (node) must be an integer"),
        (TO_COORDINATOR, {"t": "via", "n": 1, "items": 3}, "'via': field 'items'"),
        (TO_MEMBER, {"t": "to", "r": [[0, 1]], "items": [3]}, "'to': field 'items' (items) must be a list of maps"),
        (TO_COORDINATOR, {"t": "go", "g": "g", "s": 1, "o": 1, "l": "tcp"}, "unknown type 'go'"),  # wrong direction
        (TO_COORDINATOR, {"g": "g"}, "unknown type None"),
        (TO_COORDINATOR, {"t": ["ready"]}, "unknown type ['ready']"),
    ],
)
def test_malformed_items_are_refused_naming_type_and_field(vocabulary, item, needle) -> None:
    with pytest.raises(FabricMessageError, match=re.escape(needle)):
        decode(item, vocabulary)


def test_decode_batch_drops_only_the_malformed_items() -> None:
    envelope = {"t": "batch", "v": s.PROTOCOL_VERSION,
                "items": [{"t": "node_dead", "node": 1, "why": "gone"}, {"t": "node_dead", "node": "one"},
                          {"t": "rank_died", "rank": 3, "why": "exited"}]}
    messages, problems = decode_batch(envelope, TO_MEMBER)
    assert messages == [NodeDead(1, "gone"), RankDied(3, "exited")]
    assert len(problems) == 1 and "'node_dead': field 'node' (node) must be an integer" in problems[0]
    # a lone item (no envelope) is one message; a batch whose items are not a list is refused whole
    assert decode_batch({"t": "leaving", "why": "bye", "v": 2}, TO_MEMBER) == ([Leaving("bye")], [])
    with pytest.raises(FabricMessageError, match="'items' must be a list"):
        decode_batch({"t": "batch", "items": {"t": "go"}}, TO_MEMBER)


class _Node:
    """The node services a member needs for these tests (records what reaches it)."""

    def __init__(self) -> None:
        self.failed_waiting_on: list[tuple[int, str]] = []
        self.failed_nodes: list[tuple[int, str]] = []
        self.flushes = 0

    def fail_ops_waiting_on(self, rank: int, why: str) -> None:
        self.failed_waiting_on.append((rank, why))

    def fail_ops_of_node(self, node: int, message: str) -> None:
        self.failed_nodes.append((node, message))

    def fail_seq(self, group: str, seq: int, code: str, message: str) -> None:
        raise AssertionError(f"no bridged ring here, yet op #{seq} of group {group!r} failed on one: {message}")

    def flush(self) -> None:
        self.flushes += 1


class _Link:
    """The control link to the coordinator: keeps the member's receive callback to feed it frames."""

    def attach(self, loop: Any, on_message: Any, on_close: Any) -> None:
        self.deliver = on_message


def _member(node: _Node) -> tuple[FabricMember, _Link]:
    """Node 1 of a two-node fabric, started, with its link to the coordinator (node 0)."""
    nodes = [SimpleNamespace(rank=r, name=f"n{r}", ip="127.0.0.1") for r in range(2)]
    link = _Link()
    fabric = SimpleNamespace(nnodes=2, node_rank=1, is_coordinator=False, config=None, lanes={}, nodes=nodes,
                             links={0: link}, tree_links={})
    member = FabricMember(node, fabric, peer_timeout=10.0)  # type: ignore[arg-type]
    member.start(loop=None)
    return member, link


def test_a_member_logs_and_drops_a_malformed_item_and_acts_on_the_rest(caplog) -> None:
    node = _Node()
    member, link = _member(node)
    envelope = {"t": "batch", "v": s.PROTOCOL_VERSION,
                "items": [{"t": "rank_died", "rank": "three", "why": "x"},
                          {"t": "node_dead", "node": 0, "why": "stopped answering"},
                          {"t": "rank_died", "rank": 4, "why": "exited"}]}
    with caplog.at_level(logging.ERROR, logger="commd.fabric"):
        link.deliver(envelope)
    assert node.failed_waiting_on == [(4, "exited")]
    assert member.dead == {0: "stopped answering"}
    assert node.failed_nodes == [(0, "node 0 (n0) stopped answering")]  # its ranks' waiting ops fail too
    assert any("bad item from node 0 dropped" in r.getMessage() and "'rank_died': field 'rank'" in r.getMessage()
               for r in caplog.records), caplog.text
    assert node.flushes == 1


def test_an_early_forwarded_send_is_kept_apart_from_its_arrival_time() -> None:
    node = _Node()
    node.group_size = lambda name: None  # type: ignore[attr-defined]  # no local rank registered 'pp' yet
    member, link = _member(node)
    received = RemoteSend(SEND, sender_node=0).to_wire()
    link.deliver(batch([RemoteSend(SEND, sender_node=0)]))
    ((arrived, kept),) = member.early_sends["pp"]
    assert kept == RemoteSend(SEND, sender_node=0) and isinstance(arrived, float)
    assert kept.to_wire() == received  # nothing local was written into the received message
    with pytest.raises(AttributeError):
        kept.arrived = arrived  # type: ignore[attr-defined]  # (a message holds its fields only)
