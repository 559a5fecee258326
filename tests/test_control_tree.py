"""The control tree (scheduler/tree.py): reports merged up and releases routed down, log N deep.

In process (``commd.sim.control_plane``: the coordinator and a router per node exchanging real
frames): what every node receives through a tree is what a star delivers — the same releases in
the same global order, the same mismatch and timeout messages — while node 0 handles a few items
per op instead of N.  Live: 5 daemons in a tree of fan-out 2 (depth 2) run every op against
NumPy, merge their repeated reports, and a relay's death fails its subtree and every other rank.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time

import fabric_workers as fw
import pytest

from commd.protocol.fabric import Fail, Go, OpPattern, Ready
from commd.scheduler.tree import ControlTree, clip, members, ranges_of, size, union, valid
from commd.sim.control_plane import ControlPlaneModel


@pytest.mark.parametrize("fanout", [2, 3, 8])
def test_every_subtree_is_an_interval_and_the_depth_is_logarithmic(fanout: int) -> None:
    for nnodes in range(1, 80):
        tree = ControlTree(nnodes, fanout)
        assert tree.parent[0] is None and all(tree.parent[n] is not None for n in range(1, nnodes))
        for node in range(nnodes):
            lo, hi = tree.subtree(node)
            kids = tree.children[node]
            assert len(kids) <= fanout
            # the children's subtrees tile the node's interval after the node itself
            tiles = [tree.subtree(k) for k in kids]
            assert [lo + 1] + [t[1] for t in tiles] == [t[0] for t in tiles] + [hi]
            for kid in kids:
                assert tree.parent[kid] == node
        # depth: ceil(log_k) of the nodes, plus one for the uneven split at most
        bound = 0
        while fanout ** bound < nnodes:
            bound += 1
        assert tree.depth() <= bound + 1, (nnodes, fanout, tree.depth())
        assert tree.is_star == (nnodes - 1 <= fanout)


def test_routing_gives_each_addressed_node_its_message_once() -> None:
    rng = random.Random(5)
    for _ in range(200):
        nnodes, fanout = rng.randint(1, 60), rng.randint(2, 6)
        tree = ControlTree(nnodes, fanout)
        addressed = ranges_of(rng.sample(range(nnodes), rng.randint(1, nnodes)))
        got: list[int] = []
        todo = [(0, addressed)]
        while todo:  # walk the tree as the frames would
            node, ranges = todo.pop()
            mine, parts = tree.route(node, ranges)
            if mine:
                got.append(node)
            todo += parts
        assert sorted(got) == list(members(addressed))


def test_range_arithmetic_against_sets() -> None:
    rng = random.Random(9)
    for _ in range(500):
        a = set(rng.sample(range(40), rng.randint(0, 40)))
        b = set(rng.sample(range(40), rng.randint(0, 40)))
        ra, rb = ranges_of(a), ranges_of(b)
        assert set(members(ra)) == a and size(ra) == len(a)
        assert set(members(union(ra, rb))) == a | b
        lo, hi = sorted(rng.sample(range(41), 2))
        assert set(members(clip(ra, lo, hi))) == {n for n in a if lo <= n < hi}
        assert valid([list(r) for r in ra], 40)
    assert not valid([[2, 2]], 5) and not valid([[0, 3], [2, 4]], 5) and not valid([[0, 6]], 5)


def test_the_fanout_is_validated_and_travels_with_node_0s_config() -> None:
    from commd.scheduler.config import config_from_wire, parse_config

    assert parse_config({}).control_fanout == 8
    config = parse_config({"scheduler": {"control_fanout": 3}})
    assert config_from_wire(config.to_wire()).control_fanout == 3  # what a member learns in the welcome
    for bad in (1, 0, -2, 5000, "4", True):
        with pytest.raises(ValueError, match="control_fanout"):
            parse_config({"scheduler": {"control_fanout": bad}})
    wire_config = config.to_wire()
    wire_config["control_fanout"] = 1
    with pytest.raises(ValueError, match="control_fanout"):
        config_from_wire(wire_config)
    with pytest.raises(ValueError, match="fan-out of 2 or more"):
        ControlTree(5, 1)


# ---- the same op streams through a tree and through a star ------------------------------------

def patterns(nnodes: int, count: int) -> list[OpPattern]:
    everyone = list(range(nnodes))
    sig = {"dtype": "float32", "count": count, "reduce_op": "sum"}
    return [OpPattern("allreduce", sig, everyone, everyone, everyone, [n], count * 4, 30.0) for n in everyone]


def drive(nnodes: int, fanout: int, steps: int, ops: int, seed: int, odd: tuple[int, int] | None = None,
          missing: tuple[int, int] | None = None) -> ControlPlaneModel:
    """``steps`` x ``ops`` all-reduces of one group spanning every node, reported in a random node
    order per op; ``odd``: (seq, node) reports another count; ``missing``: (seq, node) never reports."""
    model = ControlPlaneModel(nnodes, fanout)
    model.coordinator.schedules_on = False
    rng = random.Random(seed)
    usual, other = patterns(nnodes, 4096), patterns(nnodes, 4000)
    cids: dict[int, int] = {}
    for step in range(steps):
        for index in range(ops):
            seq = step * ops + index
            order = list(range(nnodes))
            rng.shuffle(order)
            for node in order:
                if missing == (seq, node):
                    continue
                if odd == (seq, node):
                    model.report(node, [Ready("g", seq, other[node])])
                elif index in cids:
                    model.report(node, [Ready("g", seq, None, cids[index])])
                else:
                    model.report(node, [Ready("g", seq, usual[node])])
                if rng.random() < 0.3:
                    model.run()  # some frames cross before the next node reports
            model.run()
            if missing is not None and missing[0] == seq:
                for _ in range(model.tree.depth()):  # each relay on the way passes its partial merge up
                    model.now += 0.6
                    model.expire()
                    model.run()
                model.now += 31.0  # the op's timeout
                model.expire()
                model.run()
            for message in model.received[0]:
                if type(message) is Go and message.seq == seq and message.cache_id is not None:
                    cids.setdefault(index, message.cache_id)
    return model


def outcomes(model: ControlPlaneModel) -> list[list[tuple]]:
    def key(m: object) -> tuple:
        if type(m) is Go:
            return ("go", m.seq, m.order, m.lane)
        if type(m) is Fail:
            return ("fail", m.seq, m.code, re.sub(r"\d+\.\d+s", "Ts", m.message))
        return (type(m).__name__,)
    return [[key(m) for m in received] for received in model.received]


@pytest.mark.parametrize(("nnodes", "fanout"), [(23, 2), (23, 3), (40, 4), (9, 8)])
def test_a_tree_delivers_what_a_star_does_releases_mismatches_and_timeouts(nnodes: int, fanout: int) -> None:
    for seed, odd, missing in ((1, None, None), (2, (9, nnodes - 2), None), (3, None, (7, nnodes // 2)),
                               (4, (5, 0), (10, 1))):
        tree = drive(nnodes, fanout, 4, 4, seed, odd, missing)
        star = drive(nnodes, nnodes - 1, 4, 4, seed, odd, missing)
        got, want = outcomes(tree), outcomes(star)
        assert got == want, (seed, [g for g, w in zip(got[0], want[0], strict=False) if g != w][:3])
        assert all(node == got[0] for node in got), "every node sees the same outcomes"
        kinds = {k[0] for k in got[0]}
        assert "go" in kinds and (("fail" in kinds) == (odd is not None or missing is not None))
        if missing is not None:
            fail = next(k for k in got[0] if k[0] == "fail" and k[1] == missing[0])
            assert f"nodes [{missing[1]}]" in fail[3], fail  # names the node that never reported


def test_node_0_handles_a_few_items_per_cached_op_whatever_n() -> None:
    """The steady state: each of node 0's children sends one merged set per op, so node 0's items
    per op are its fan-out, and the busiest relay's about twice its fan-out."""
    ops = 8
    for nnodes in (16, 64, 256):
        model = drive(nnodes, 4, 3, ops, seed=nnodes)
        before = [c.items_in for c in model.counts]
        model = drive(nnodes, 4, 4, ops, seed=nnodes)  # one step more: its cost is the difference
        per_op = [(c.items_in - b) / ops for c, b in zip(model.counts, before, strict=True)]
        assert per_op[0] <= 4, per_op[0]
        assert max(per_op) <= 2 * 4 + 1, max(per_op)
        assert model.coordinator.stats.coord_fast_path >= 3 * ops


# ---- live -------------------------------------------------------------------------------------

@pytest.fixture
def tree_of_five(cluster, monkeypatch):
    """5 daemons x 1 rank under a control tree of fan-out 2: 0 -> {1, 3}, 1 -> 2, 3 -> 4; every op negotiated."""
    monkeypatch.setenv("COMMD_CONTROL_FANOUT", "2")
    monkeypatch.setenv("COMMD_SCHEDULE", "0")

    def make(**kwargs):
        return cluster(5, 1, **kwargs)

    return make


@pytest.mark.extended  # make test-extended (CI runs it after make test); 30 s
def test_every_op_a_repeated_loop_and_a_mismatch_through_a_tree_of_relays(tree_of_five) -> None:
    c = tree_of_five()
    assert set(c.join(c.start_workers(fw.every_op, ["tcp", "gloo"], [5, 70_000]), timeout=240).values()) == {"ok"}
    steps = 12
    results = c.join(c.start_workers(fw.control_tree_loop, steps), timeout=240)
    trees = {rank: value["tree"] for rank, value in results.items()}
    assert trees[0]["children"] == [1, 3] and trees[1]["children"] == [2] and trees[2]["parent"] == 1
    assert {t["depth"] for t in trees.values()} == {2}
    for relay in (1, 3):  # the repeated ops' reports of each relay's subtree went up merged
        assert trees[relay]["merged_reports"] >= 2 * (steps - 2) * 3, trees[relay]
    for rank, value in results.items():
        assert value["paths"]["negotiated"] >= steps * 3, (rank, value)
    # a mismatch: the same message on every rank, naming the field and the ranks, as on a star
    results = c.join(c.start_workers(fw.mismatch), timeout=120)
    messages = {value["message"] for value in results.values()}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "'count' differs: ranks [0, 1] 8, ranks [2, 3, 4] 9" in message, message


@pytest.mark.extended
def test_a_relay_that_dies_fails_its_subtree_and_every_other_rank(tree_of_five) -> None:
    """Node 1 relays node 2's reports: its daemon is SIGKILLed while the others wait in an op; every
    rank left (node 2's, cut off from node 0, too) raises an error naming node 1, within bounds."""
    c = tree_of_five(peer_timeout=2.0, op_timeout=30.0)
    workers = c.start_workers(fw.fault_on_schedule, 3, [1])
    for node in (0, 2, 3, 4):
        workers[node].wait_event(node, "submitted")
    started = time.monotonic()
    os.kill(c.daemon_pid(1), signal.SIGKILL)
    results = {}
    for node in (0, 2, 3, 4):
        results.update(workers[node].join(timeout=60))
    assert time.monotonic() - started < 20, "the errors took longer than the peer timeout allows"
    assert sorted(results) == [0, 2, 3, 4], results
    for rank, text in results.items():
        assert text.startswith("PeerDiedError") and "node 1 (n1)" in text, (rank, text)
    assert "control tree" in results[2], results[2]  # node 2 is told why it is cut off


@pytest.mark.extended  # make test-extended (CI runs it after make test); 40 s
def test_a_relay_that_dies_under_ddp_fails_ddp_and_every_api_on_the_other_ranks(tree_of_five) -> None:
    """DDP through the torch backend, its buckets negotiated through the tree; node 1's daemon (a
    relay) is SIGKILLed before a step: every other rank's backward raises naming node 1, and so do a
    later all-reduce's ``get_future()`` and ``wait()``."""
    from cluster import free_port

    c = tree_of_five(peer_timeout=2.0, op_timeout=30.0)
    fail_step = 6
    workers = c.start_workers(fw.ddp_fault_on_schedule, free_port(), fail_step, True)
    for node in range(5):
        workers[node].wait_event(node, "on schedule")
    started = time.monotonic()
    os.kill(c.daemon_pid(1), signal.SIGKILL)
    for node in (0, 2, 3, 4):
        workers[node].wait_event(node, "done")
    assert time.monotonic() - started < 30, "the errors took longer than the peer timeout allows"
    results = {}
    for node in (0, 2, 3, 4):
        workers[node].send(node, "go")
        results.update(workers[node].join(timeout=60))
    for rank, result in results.items():
        assert result["steps"] == list(range(fail_step)), (rank, result)
        for api in ("ddp", "future", "wait"):
            assert "PeerDiedError" in result[api] and "node 1 (n1)" in result[api], (rank, api, result[api][:300].replace(chr(10), " "))
