"""The coordinator and the lane choice as pure logic (no daemons, no sockets)."""

from __future__ import annotations

import pytest

from commd.execution.workers import worker_key
from commd.protocol import schema as s
from commd.protocol.fabric import P2pMatch, P2pSend, Ready
from commd.scheduler.config import LaneRule, SchedulerConfig, load_config, parse_config
from commd.scheduler.coordinator import Coordinator, Outbox
from commd.scheduler.selection import SelectionError, choose_lane


class FakeLane:
    def __init__(self, refuse: set[str] | None = None) -> None:
        self.refuse = refuse or set()

    def can_run(self, primitive, dtype, reduce_op, nodes):
        return f"no {dtype}" if dtype in self.refuse else None


LANES = {"tcp": FakeLane(), "gloo": FakeLane({"bool"})}


def entry(group="g", seq=0, kind="allreduce", mine=(0, 1), count=4, ranks=(0, 1, 2, 3), pl=(0, 0, 1, 1), **kw):
    sig = {"lane": "", "dtype": "float32", "count": count, "reduce_op": "sum", "scale": 1.0}
    sig.update(kw.pop("sig", {}))
    item = {"t": "ready", "g": group, "s": seq, "k": kind, "sig": sig, "ranks": list(ranks), "pl": list(pl),
            "n": sorted(set(pl)), "mine": list(mine), "nb": count * 4, "to": 30.0}
    item.update(kw)
    return item


def ready(items: list[dict]) -> list[Ready]:
    """Reports as the coordinator receives them: decoded from the wire form ``entry`` builds."""
    return [Ready.from_wire(item) for item in items]


def sent(out: Outbox) -> dict[int, list[dict]]:
    """What the coordinator sends each node, in wire form."""
    return {node: [m.to_wire() for m in messages] for node, messages in out.messages.items()}


def p2p_send(key: int, dst_node: int, nbytes: int, dst: int) -> P2pSend:
    return P2pSend(key, dst_node, "g", 0, dst, 0, "uint8", nbytes, nbytes, 30.0, None)


def test_release_waits_for_every_node_and_numbers_globally() -> None:
    coord = Coordinator(2, SchedulerConfig(), LANES)
    out = Outbox()
    coord.report(0, ready([entry(seq=0), entry(group="h", seq=0)]), out)
    assert not out.messages  # node 1 has not reported yet
    coord.report(1, ready([entry(group="h", seq=0, mine=[2, 3]), entry(seq=0, mine=[2, 3])]), out)
    orders = {(m["g"], m["o"]) for m in sent(out)[0]}
    assert orders == {("h", 1), ("g", 2)}  # released in the order they became complete
    assert [m["o"] for m in sent(out)[0]] == [m["o"] for m in sent(out)[1]]
    assert all(m["l"] == "tcp" for m in sent(out)[0])


def test_cached_pattern_takes_the_fast_path() -> None:
    coord = Coordinator(2, SchedulerConfig(), LANES)
    out = Outbox()
    coord.report(0, ready([entry(seq=0)]), out)
    coord.report(1, ready([entry(seq=0, mine=[2, 3])]), out)
    cid = sent(out)[0][0]["c"]
    assert sent(out)[1][0]["c"] == cid
    out = Outbox()
    coord.report(0, ready([{"t": "ready", "g": "g", "s": 1, "c": cid}]), out)
    coord.report(1, ready([{"t": "ready", "g": "g", "s": 1, "c": cid}]), out)
    assert sent(out)[0][0]["t"] == "go" and coord.stats.coord_fast_path == 1
    # one node cached, the other sends a different pattern: compared in full, mismatch found
    out = Outbox()
    coord.report(0, ready([{"t": "ready", "g": "g", "s": 2, "c": cid}]), out)
    coord.report(1, ready([entry(seq=2, mine=[2, 3], count=5)]), out)
    assert sent(out)[1][0]["t"] == "fail"
    assert "'count' differs: ranks [0, 1] 4, ranks [2, 3] 5" in sent(out)[1][0]["m"]


@pytest.mark.parametrize(
    ("change", "field"),
    [({"kind": "broadcast"}, "'kind'"), ({"ranks": (0, 1, 2, 4)}, "'group members'"),
     ({"sig": {"dtype": "int32"}}, "'dtype'"), ({"sig": {"reduce_op": "max"}}, "'reduce_op'"),
     ({"sig": {"lane": "gloo"}}, "'lane'")],
)
def test_mismatch_names_field_and_ranks(change, field) -> None:
    coord = Coordinator(2, SchedulerConfig(), LANES)
    out = Outbox()
    coord.report(0, ready([entry()]), out)
    coord.report(1, ready([entry(mine=[2, 3], **change)]), out)
    messages = sent(out)[0] + sent(out)[1]
    assert all(m["t"] == "fail" and m["code"] == "mismatch" for m in messages)
    assert field in messages[0]["m"] and "ranks [0, 1]" in messages[0]["m"]


def test_alltoall_split_disagreement_is_reported() -> None:
    coord = Coordinator(2, SchedulerConfig(), LANES)
    out = Outbox()
    sig = {"reduce_op": None}
    coord.report(0, ready([entry(kind="alltoall", sig=sig, a2a=[[0, [1, 1, 1, 1], [1, 1, 1, 1]],
                                                                [1, [1, 1, 1, 1], [1, 1, 1, 1]]])]), out)
    coord.report(1, ready([entry(kind="alltoall", mine=[2, 3], sig=sig, a2a=[[2, [1, 1, 1, 1], [2, 1, 1, 1]],
                                                                             [3, [1, 1, 1, 1], [1, 1, 1, 1]]])]), out)
    assert "rank 0 sends 1 elements to rank 2, which expects 2" in sent(out)[0][0]["m"]


def test_timeout_names_missing_nodes_and_ranks() -> None:
    coord = Coordinator(3, SchedulerConfig(), LANES)
    out = Outbox()
    pl = (0, 1, 2)
    coord.report(0, ready([entry(ranks=(0, 1, 2), pl=pl, mine=[0], to=1.0)]), out)
    coord.partial[2] = {}
    rows = coord.stalls(coord.pending[("g", 0)].first_at + 5, 1.0)
    assert rows[0]["missing_nodes"] == [1, 2] and rows[0]["missing_ranks"] == [1, 2]
    coord.expire(coord.pending[("g", 0)].first_at + 5, out)
    assert sent(out)[0][0]["code"] == "timeout"
    assert "nodes [1, 2]" in sent(out)[0][0]["m"]


def test_a_timed_out_op_fails_every_node_and_a_late_report_fails_on_arrival() -> None:
    """The nodes that never reported a timed-out op hear of it too (they drop node 0's early
    contribution), and a late report of it fails at once with the same words instead of waiting
    for a node that will never report it again."""
    coord = Coordinator(2, SchedulerConfig(), LANES)
    out = Outbox()
    coord.report(0, ready([entry(to=1.0)]), out)
    coord.expire(coord.pending[("g", 0)].first_at + 5, out)
    first = sent(out)
    assert [m["code"] for m in first[0]] == ["timeout"] and [m["code"] for m in first[1]] == ["timeout"], first
    assert first[0][0]["m"] == first[1][0]["m"] and "nodes [1]" in first[0][0]["m"]
    out = Outbox()
    coord.report(1, ready([entry(mine=[2, 3], to=1.0)]), out)
    late = sent(out)
    assert late == {1: [first[1][0]]} and ("g", 0) not in coord.pending, late
    out = Outbox()  # the next op of the group is unaffected
    coord.report(0, ready([entry(seq=1)]), out)
    coord.report(1, ready([entry(seq=1, mine=[2, 3])]), out)
    assert all(m["t"] == "go" for ms in sent(out).values() for m in ms), sent(out)


def test_dead_node_fails_pending_and_later_reports() -> None:
    coord = Coordinator(2, SchedulerConfig(), LANES)
    out = Outbox()
    coord.report(0, ready([entry()]), out)
    coord.node_dead(1, "stopped answering", out)
    assert sent(out)[0][0]["code"] == "peer_died"
    out = Outbox()
    coord.report(0, ready([entry(seq=1)]), out)
    assert sent(out)[0][0]["t"] == "fail" and "node 1 stopped answering" in sent(out)[0][0]["m"]


def test_p2p_is_forwarded_then_ordered_on_both_nodes() -> None:
    coord = Coordinator(2, SchedulerConfig(), LANES)
    out = Outbox()
    coord.p2p_send(0, p2p_send(7, 1, 16, 3), out)
    assert sent(out)[1][0]["t"] == "remote_send" and sent(out)[1][0]["sn"] == 0
    out = Outbox()
    coord.p2p_match(1, P2pMatch(0, 7), out)
    assert sent(out)[0][0]["role"] == "send" and sent(out)[1][0]["role"] == "recv"
    assert sent(out)[0][0]["o"] == sent(out)[1][0]["o"]


def test_lane_choice_order_hint_rules_default() -> None:
    config = SchedulerConfig(rules=[LaneRule("gloo", "allreduce", min_bytes=1024)])
    args = ("allreduce", "float32", "sum")
    assert choose_lane(*args, 4096, (0, 1), 4, None, config, LANES) == "gloo"
    assert choose_lane(*args, 16, (0, 1), 4, None, config, LANES) == "tcp"
    assert choose_lane(*args, 4096, (0, 1), 4, "tcp", config, LANES) == "tcp"
    # a rule whose lane cannot run the op is skipped; a hint that cannot is an error
    assert choose_lane("allreduce", "bool", "max", 4096, (0, 1), 4, None, config, LANES) == "tcp"
    with pytest.raises(SelectionError, match="lane 'gloo'.*no bool"):
        choose_lane("allreduce", "bool", "max", 4096, (0, 1), 4, "gloo", config, LANES)
    with pytest.raises(SelectionError, match="'mpi' is not available"):
        choose_lane(*args, 16, (0, 1), 4, "mpi", config, LANES)


def test_exclusion_rule_serializes_gpu_ops_of_nccl_and_mpi() -> None:
    assert worker_key("nccl", True) == worker_key("mpi", True) == "gpu-exclusive"
    assert worker_key("mpi", False) == "mpi" and worker_key("tcp", True) == "tcp"


def test_config_file_validation(tmp_path) -> None:
    good = tmp_path / "ok.toml"
    good.write_text('[scheduler]\ndefault_lane = "gloo"\nstall_warning_s = 5\n\n'
                    '[[rules]]\nkind = "allreduce"\nmin_bytes = 1048576\nlane = "tcp"\n')
    config = load_config(good)
    assert config.default_lane == "gloo" and config.rules[0].min_bytes == 1 << 20
    for text, needle in [
        ('[scheduler]\ndefault_lane = "carrier-pigeon"\n', "default_lane"),
        ('[[rules]]\nlane = "tcp"\nkind = "allreduce"\nmin_bytes = -1\n', "min_bytes"),
        ('[[rules]]\nlane = "tcp"\nkind = "fold"\n', "'kind'"),
        ("[scheduler]\nstall_warning_s = 10\nstall_shutdown_s = 5\n", "stall_shutdown_s"),
        ("[lanes]\n", "unknown section"),
        ("not toml ][", "not valid TOML"),
    ]:
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(ValueError, match=needle):
            load_config(bad)
    with pytest.raises(ValueError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    assert parse_config({}).default_lane == "tcp"


def test_tiny_allreduce_is_reduced_by_the_coordinator_in_node_order() -> None:
    import numpy as np

    coord = Coordinator(2, SchedulerConfig(), LANES)
    out = Outbox()
    a, b = np.array([1.5, 2.0], np.float32), np.array([0.25, -1.0], np.float32)
    coord.report(0, ready([dict(entry(count=2), d=a.tobytes())]), out)
    coord.report(1, ready([dict(entry(count=2, mine=[2, 3]), d=b.tobytes())]), out)
    results = {np.frombuffer(m["r"], np.float32).tobytes() for n in (0, 1) for m in sent(out)[n]}
    assert results == {(a + b).tobytes()}
    # one node without its contribution (or a lane other than tcp): the lane runs it
    out = Outbox()
    coord.report(0, ready([dict(entry(seq=1, count=2), d=a.tobytes())]), out)
    coord.report(1, ready([entry(seq=1, count=2, mine=[2, 3])]), out)
    assert "r" not in sent(out)[0][0]


def test_node_0_sends_its_tiny_contribution_early_only_when_the_other_node_may_use_it() -> None:
    """A cached tiny tcp all-reduce of a 2-node group that node 0 reports first: its contribution
    goes to the other node at once (which then needs no release); the release still follows,
    with the result the other node computes from the same bytes in the same node order."""
    import numpy as np

    coord = Coordinator(2, SchedulerConfig(), LANES)
    a, b = np.array([1.5, 2.0], np.float32), np.array([0.25, -1.0], np.float32)
    out = Outbox()
    coord.report(0, ready([dict(entry(count=2), d=a.tobytes())]), out)
    assert not out.messages, "a pattern without a cache id is compared by the coordinator: nothing early"
    coord.report(1, ready([dict(entry(count=2, mine=[2, 3]), d=b.tobytes())]), out)
    cid = sent(out)[0][0]["c"]
    out = Outbox()
    coord.report(0, ready([{"t": "ready", "g": "g", "s": 1, "c": cid, "d": a.tobytes()}]), out)
    assert sent(out) == {1: [{"t": "early", "g": "g", "s": 1, "c": cid, "d": a.tobytes()}]}
    out = Outbox()
    coord.report(1, ready([{"t": "ready", "g": "g", "s": 1, "c": cid, "d": b.tobytes()}]), out)
    assert [m["t"] for m in sent(out)[1]] == ["go"] and sent(out)[1][0]["r"] == (a + b).tobytes()
    # node 1 first: node 0's report completes the op, the release carries the result; nothing early
    out = Outbox()
    coord.report(1, ready([{"t": "ready", "g": "g", "s": 2, "c": cid, "d": b.tobytes()}]), out)
    coord.report(0, ready([{"t": "ready", "g": "g", "s": 2, "c": cid, "d": a.tobytes()}]), out)
    assert [m["t"] for m in sent(out)[1]] == ["go"]
    # no contribution from node 0, or a cached lane other than tcp: nothing early
    out = Outbox()
    coord.report(0, ready([{"t": "ready", "g": "g", "s": 3, "c": cid}]), out)
    assert not out.messages
    coord.report(0, ready([dict(entry(group="h", count=2, sig={"lane": "gloo"}), d=a.tobytes())]), out)
    coord.report(1, ready([dict(entry(group="h", count=2, mine=[2, 3], sig={"lane": "gloo"}), d=b.tobytes())]), out)
    gloo_cid = next(m["c"] for m in sent(out)[0] if m["g"] == "h")
    out = Outbox()
    coord.report(0, ready([{"t": "ready", "g": "h", "s": 1, "c": gloo_cid, "d": a.tobytes()}]), out)
    assert not out.messages


def test_no_early_contribution_for_groups_of_three_nodes() -> None:
    import numpy as np

    coord = Coordinator(3, SchedulerConfig(), LANES)
    pl, a = (0, 1, 2), np.ones(2, np.float32).tobytes()
    out = Outbox()
    for node in range(3):
        coord.report(node, ready([dict(entry(count=2, ranks=(0, 1, 2), pl=pl, mine=[node]), d=a)]), out)
    cid = sent(out)[0][0]["c"]
    out = Outbox()
    coord.report(0, ready([{"t": "ready", "g": "g", "s": 1, "c": cid, "d": a}]), out)
    assert not out.messages


def test_a_failure_while_releasing_fails_the_op_instead_of_leaving_it(monkeypatch) -> None:
    coord = Coordinator(2, SchedulerConfig(), LANES)
    monkeypatch.setattr(coord, "_eager_result", lambda *a: 1 / 0)
    out = Outbox()
    coord.report(0, ready([entry()]), out)
    coord.report(1, ready([entry(mine=[2, 3])]), out)
    assert sent(out)[0][0]["t"] == "fail" and sent(out)[1][0]["code"] == "internal"
    assert not coord.pending


NAMES = ["alpha", "beta", "gamma"]


def test_errors_name_the_op_kind_and_the_nodes() -> None:
    """Every failure the coordinator sends says which op (kind, seq, group) and which nodes, by name."""
    coord = Coordinator(3, SchedulerConfig(), LANES, NAMES)
    pl = (0, 1, 2)
    # mismatch between nodes 0 and 1 of a broadcast
    out = Outbox()
    coord.report(0, ready([entry(kind="broadcast", ranks=(0, 1), pl=(0, 1), mine=[0])]), out)
    coord.report(1, ready([entry(kind="broadcast", ranks=(0, 1), pl=(0, 1), mine=[1], count=5)]), out)
    message = sent(out)[0][0]["m"]
    assert "broadcast #0 on group 'g'" in message and "nodes [0, 1] (alpha, beta)" in message, message
    # timeout waiting for nodes 1 and 2 of an all-gather
    out = Outbox()
    coord.report(0, ready([entry(group="t", kind="allgather", ranks=(0, 1, 2), pl=pl, mine=[0], to=1.0)]), out)
    coord.expire(coord.pending[("t", 0)].first_at + 5, out)
    message = sent(out)[0][0]["m"]
    assert "allgather #0 on group 't'" in message and "nodes [1, 2] (beta, gamma)" in message, message
    assert s.missing_ranks_in(message) == [1, 2], message  # what the client's CommTimeoutError.missing_ranks reads
    # a node dies while an all-reduce waits for it
    out = Outbox()
    coord.report(0, ready([entry(group="d", ranks=(0, 1, 2), pl=pl, mine=[0])]), out)
    coord.node_dead(2, "stopped answering", out)
    message = sent(out)[0][0]["m"]
    assert message.startswith("allreduce #0 on group 'd' cannot run: node 2 (gamma) stopped answering"), message
    # a rank dies while a reduce waits for it
    out = Outbox()
    coord.report(0, ready([entry(group="r", kind="reduce", ranks=(0, 1), pl=(0, 1), mine=[0])]), out)
    coord.rank_died(1, 1, "died", out)
    message = sent(out)[0][0]["m"]
    assert "reduce #0 on group 'r'" in message and "rank 1 (on node 1 (beta)) died" in message, message
    # a later op for the dead node, and a send to it
    out = Outbox()
    coord.report(0, ready([entry(group="e", kind="gather", ranks=(0, 2), pl=(0, 2), mine=[0])]), out)
    coord.p2p_send(0, p2p_send(1, 2, 4, 1), out)
    gather, send = sent(out)[0]
    assert gather["m"].startswith("gather #0 on group 'e' cannot run: node 2 (gamma)"), gather
    assert "node 2 (gamma) stopped answering" in send["m"], send


def test_a_codec_takes_the_tcp_lane_and_refuses_another_lane_or_a_program() -> None:
    """A compressed op is released on the tcp lane; with another lane named, or a lossy codec with a
    program as well (whose partial results it would round at every hop), it fails on every node
    naming both."""
    coord = Coordinator(2, SchedulerConfig(), LANES)
    cases = [({"codec": "bf16"}, None), ({"codec": "bf16", "lane": "gloo"}, "compresses on the tcp lane only"),
             ({"codec": "bf16", "algo": "ag"}, "codec 'bf16' is lossy; algorithm 'ag' runs compressed with "
                                               "lossless codecs only")]
    for seq, (sig, refusal) in enumerate(cases):
        out = Outbox()
        for node, mine in ((0, [0, 1]), (1, [2, 3])):
            coord.report(node, ready([entry(seq=seq, kind="allgather", mine=mine, sig=sig)]), out)
        messages = sent(out)[0] + sent(out)[1]
        if refusal is None:
            assert [m["t"] for m in messages] == ["go", "go"] and all(m["l"] == "tcp" for m in messages), messages
        else:
            assert all(m["t"] == "fail" and refusal in m["m"] for m in messages), messages
