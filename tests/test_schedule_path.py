"""The schedule path (fabric/scheduled.py): a loop that repeats itself runs without the coordinator.

Live: 2 nodes x 2 ranks on loopback, every result against NumPy, the same mismatch error
on the schedule as on negotiation, every kind of deviation, and no control message at all
for the ops that follow the schedule; 3 nodes, tiny all-reduces done in their agreement
with the coordinator's bits.  In process: the cycle finder and the coordinator's
side of a schedule (publish, stale reports, what waits for the end).
"""

from __future__ import annotations

import os
import re
import signal
import time

import fabric_workers as fw
import pytest

from commd.protocol.fabric import (
    OpPattern,
    P2pMatch,
    P2pSend,
    Ready,
    RemoteSend,
    Schedule,
    ScheduleEnded,
    ScheduleSlot,
    StopSchedule,
)
from commd.scheduler.config import SchedulerConfig
from commd.scheduler.coordinator import Coordinator, Outbox
from commd.scheduler.cycles import MIN_WINDOW, CycleDetector


class AnyLane:
    def can_run(self, primitive, dtype, reduce_op, nodes):
        return None


LANES = {"tcp": AnyLane()}


def test_a_repeating_loop_runs_on_the_schedule_and_leaves_it_cleanly(cluster) -> None:
    c = cluster()
    results = c.join(c.start_workers(fw.schedule_path, 3, 10), timeout=240)
    seq = re.compile(r"#\d+")
    for rank, value in results.items():
        # the same message, whichever path found the mismatch (the op's number aside)
        assert "'count' differs" in value["scheduled_mismatch"], (rank, value)
        assert seq.sub("#N", value["scheduled_mismatch"]) == seq.sub("#N", value["negotiated_mismatch"]), value
        before, after = value["before"], value["after"]
        # 10 steps of 3 ops after the warm-up: every one released on the schedule, not one control item
        assert after["paths"]["scheduled"] - before["paths"]["scheduled"] == 30, value
        assert after["paths"]["negotiated"] == before["paths"]["negotiated"], value
        assert after["control"] == before["control"], value
        assert value["final"]["paths"]["fallback"] >= 1, value
    for node in (0, 1):
        schedules = c.status(node)["fabric"]["schedules"]
        assert schedules["started"] >= 4 and schedules["ended"] >= 4, schedules  # one per deviation


@pytest.mark.extended
def test_tiny_all_reduces_on_three_nodes_ride_the_agreement_with_the_coordinators_bits(cluster) -> None:
    """On more than 2 nodes a tiny all-reduce's contributions are gathered by its slot's agreement
    and combined in node order: the same bits as the coordinator's combination on negotiation."""
    c = cluster(3, 1)
    steps = 12
    results = c.join(c.start_workers(fw.schedule_gather, steps), timeout=240)
    for rank, value in results.items():
        assert value["bitwise_equal_steps"] == steps, (rank, value)
        assert value["paths"]["scheduled"] >= 3 * 4, (rank, value)  # at least 4 steps on the schedule
        assert value["schedule"]["reduced_in_agreement"] >= 2 * 4, (rank, value)  # their 2 tiny ops each
        # ops waited one at a time: the lane is idle at each tiny op, whose rounds run on the event loop
        assert value["schedule"]["slots_run"]["split"] >= 2 * 4, (rank, value)


@pytest.mark.extended
def test_a_dead_node_fails_a_gathered_agreement_on_three_nodes_in_bounded_time(cluster) -> None:
    """3 nodes: the tiny all-reduce's agreement runs its rounds on the event loops when node 2's
    daemon is SIGKILLed; the other nodes' ranks raise an error naming it, not a hang."""
    c = cluster(3, 2, peer_timeout=2.0, op_timeout=30.0)
    workers = c.start_workers(fw.fault_on_schedule, 6, 2)
    for w in workers:
        for rank in w.procs:
            assert w.wait_event(rank, "warm")["scheduled"] > 0  # (on the schedule before the fault)
    for node in (0, 1):
        for rank in workers[node].procs:
            workers[node].wait_event(rank, "submitted")
    started = time.monotonic()
    os.kill(c.daemon_pid(2), signal.SIGKILL)
    results = {**workers[0].join(timeout=60), **workers[1].join(timeout=60)}
    assert time.monotonic() - started < 20, "the error took longer than the peer timeout allows"
    assert sorted(results) == [0, 1, 2, 3], results
    for rank, text in results.items():
        assert "PeerDied" in text and ("node 2" in text or "n2" in text), (rank, text)


def test_a_rank_that_dies_under_ddp_on_the_schedule_fails_ddp_and_every_api_on_the_others(cluster) -> None:
    """DDP's buckets through the daemons go onto the schedule; rank 1 is SIGKILLed before a step:
    rank 0's backward raises naming rank 1, and so do a later all-reduce's future and wait()."""
    from cluster import free_port

    c = cluster(2, 1, peer_timeout=2.0, op_timeout=30.0)
    fail_step = 10
    workers = c.start_workers(fw.ddp_fault_on_schedule, free_port(), fail_step)
    for w in workers:
        for rank in w.procs:
            assert w.wait_event(rank, "on schedule")["scheduled"] > 0  # (the buckets run on the schedule)
    started = time.monotonic()
    os.kill(workers[1].procs[1].pid, signal.SIGKILL)
    result = workers[0].join(timeout=90)[0]
    assert time.monotonic() - started < 30, "the error took longer than the peer timeout allows"
    assert result["steps"] == list(range(fail_step)), result
    for api in ("ddp", "future", "wait"):
        assert "rank 1" in result[api] and "died" in result[api], (api, result)


# ---- in process --------------------------------------------------------------------------

def slot(cid: int) -> ScheduleSlot:
    return ScheduleSlot(cid, "tcp")


def test_the_cycle_finder_needs_the_same_cycle_twice_in_consecutive_ops() -> None:
    finder = CycleDetector()
    found = [finder.released("g", seq, slot(cid)) for seq, cid in enumerate([9, 1, 2, 3, 1, 2])]
    assert found == [None] * 6
    cycle = finder.released("g", 6, slot(3))
    assert cycle is not None and cycle.start_seq == 7 and [s.cache_id for s in cycle.slots] == [1, 2, 3]
    # a sequence number that goes back, another group or an unschedulable release starts again (a gap
    # does not: the group's ops on an exchange ring take numbers too)
    for interrupt in (lambda f: f.released("g", 0, slot(1)), lambda f: f.released("h", 0, slot(1)),
                      lambda f: f.released("g", 7, None)):
        finder = CycleDetector()
        for seq in range(3):
            finder.released("g", seq, slot(1))
        interrupt(finder)
        assert finder.released("g", 100, slot(1)) is None
    finder = CycleDetector()
    found = [finder.released("g", 10 * seq, slot(cid)) for seq, cid in enumerate([5, 6, 5, 6])]
    assert found[-1] is not None and found[-1].start_seq == 31  # (gaps: the ring's ops between)
    # a cycle of one op repeats over the whole window, not just twice ([8, 8] within [7, 8, 8, 9] is none)
    finder = CycleDetector()
    assert not any(finder.released("g", seq, slot(cid)) for seq, cid in enumerate([7, 8, 8, 9, 7, 8, 8]))
    # one op repeated: a cycle of one once the window is long enough; a schedule that ended doubles it
    finder = CycleDetector()
    found = [finder.released("g", seq, slot(4)) for seq in range(MIN_WINDOW)]
    assert found[:-1] == [None] * (MIN_WINDOW - 1) and found[-1] is not None and len(found[-1].slots) == 1
    finder.backoff()
    found = [finder.released("g", seq, slot(4)) for seq in range(2 * MIN_WINDOW)]
    assert found.index(next(f for f in found if f is not None)) == 2 * MIN_WINDOW - 1


SIG = {"lane": "", "dtype": "float32", "count": 4, "reduce_op": "sum", "scale": 1.0}


def pattern(node: int) -> OpPattern:
    return OpPattern(kind="allreduce", signature=SIG, ranks=[0, 1], placement=[0, 1], nodes=[0, 1], mine=[node],
                     nbytes=16, timeout=30.0)


def coordinator() -> Coordinator:
    return Coordinator(2, SchedulerConfig(), LANES)


def run_ops(coord: Coordinator, seqs: range, cid: int | None) -> Outbox:
    """Each op in its own dispatch (as ops waited for one by one are: nothing fuses)."""
    every = Outbox()
    for seq in seqs:
        out = Outbox()
        for node in (0, 1):
            item = Ready("g", seq, pattern(node)) if cid is None else Ready("g", seq, None, cid)
            coord.report(node, [item], out)
        every.entries.extend(out.entries)
    return every


def test_the_coordinator_publishes_a_schedule_and_orders_what_waits_after_its_end() -> None:
    coord = coordinator()
    run_ops(coord, range(1), None)
    cid = next(iter(coord.cache))
    out = run_ops(coord, range(1, MIN_WINDOW), cid)
    published = [m for m in out.messages[1] if isinstance(m, Schedule)]
    assert len(published) == 1 and published[0].start_seq == MIN_WINDOW and published[0].nodes == [0, 1]
    assert published[0].order == coord.order + 1 and [s.cache_id for s in published[0].slots] == [cid]
    # reports sent before a node had the schedule are dropped: the node runs those ops itself
    out = Outbox()
    coord.report(1, [Ready("g", MIN_WINDOW, None, cid)], out)
    assert not out.messages and coord.stats.coord_stale_reports == 1 and not coord.pending
    # an op of another group waits for the end, and stops the schedule on every node
    other = Ready("h", 0, OpPattern(kind="broadcast", signature={"dtype": "uint8", "count": 1, "root": 0},
                                    ranks=[0, 1], placement=[0, 1], nodes=[0, 1], mine=[0], nbytes=1, timeout=30.0))
    out = Outbox()
    coord.report(0, [other], out)
    assert [type(m) for m in out.messages[0]] == [StopSchedule] and [type(m) for m in out.messages[1]] == [StopSchedule]
    # so does a transfer to order
    send = P2pSend(key=1, dst_node=1, group="g", src=0, dst=1, tag=0, dtype="uint8", count=1, nbytes=1, timeout=30.0,
                   lane_hint=None)
    out = Outbox()
    coord.p2p_send(0, send, out)
    assert [type(m) for m in out.messages[1]] == [RemoteSend]
    coord.p2p_match(1, P2pMatch(sender_node=0, key=1), out)
    assert len(out.messages[1]) == 1  # (the match waits; the schedule is already stopping)
    # the first node to end it: what waited takes the places from the first one the schedule did not run
    end = published[0].order + 7
    out = Outbox()
    coord.schedule_end(1, ScheduleEnded(published[0].epoch, end), out)
    assert not coord.schedule_active and ("h", 0) in coord.pending  # (replayed: waits for node 1's report)
    p2p_go = [m for m in out.messages[0] if type(m).__name__ == "P2pGo"]
    assert p2p_go and p2p_go[0].order == end
    # node 0 has not ended yet: its report of a scheduled op is still one it runs itself
    out = Outbox()
    coord.report(0, [Ready("g", MIN_WINDOW + 1, None, cid)], out)
    assert coord.stats.coord_stale_reports == 2
    coord.schedule_end(0, ScheduleEnded(published[0].epoch, end), out)
    out = Outbox()
    coord.report(0, [Ready("g", MIN_WINDOW + 7, None, cid)], out)
    coord.report(1, [Ready("g", MIN_WINDOW + 7, None, cid)], out)
    gos = [m for m in out.messages[1] if type(m).__name__ == "Go"]
    assert len(gos) == 1 and gos[0].order > end


@pytest.mark.parametrize("why", ["node_dead", "rank_died"])
def test_a_failure_stops_a_running_schedule(why: str) -> None:
    coord = Coordinator(3, SchedulerConfig(), LANES)
    coord.schedule = Schedule(1, "g", [0, 1, 2], 5, 3, [slot(1)])
    coord.schedule_active = True
    out = Outbox()
    if why == "node_dead":
        coord.node_dead(2, "vanished", out)
    else:
        coord.rank_died(2, 5, "killed", out)
    assert all(any(isinstance(m, StopSchedule) for m in out.messages[n]) for n in (0, 1))


@pytest.mark.extended  # several processes, ~10 s: make test-extended (CI runs it too)
def test_a_late_rank_on_the_schedule_times_out_as_on_negotiation(cluster) -> None:
    """The op timeout runs from when an op was ready, whatever path holds it: the on-time ranks
    fail after about the timeout naming the late ranks, the late ones fail on arrival."""
    timeout = 1.0
    c = cluster(op_timeout=timeout)
    results = c.join(c.start_workers(fw.late_on_schedule, 6, 1.5 * timeout), timeout=120)
    for rank, value in results.items():
        assert "did not submit it within the op timeout" in value["message"], (rank, value)
        assert "(global ranks [2, 3])" in value["message"], (rank, value)
        paths = value["counters"]["paths"]
        if rank >= 2:
            assert value["waited"] < timeout / 2, (rank, value)  # late: fails on arrival
        else:  # the on-time node held the op on the schedule, then handed it back to negotiation
            assert timeout * 0.9 < value["waited"] < timeout + 1.0, (rank, value)
            assert paths["fallback"] >= 1, value
        assert paths["scheduled"] > 0, value
    assert "asks to end schedule" in c.logs()


@pytest.mark.parametrize("victim", ["daemon", pytest.param("rank", marks=pytest.mark.extended)])  # (make test-extended)
def test_a_death_on_the_schedule_fails_the_waiting_ranks_in_bounded_time(cluster, victim: str) -> None:
    """Node 0's ranks wait in a scheduled op when node 1's daemon, or one of its ranks, is SIGKILLed:
    they raise an error naming what died, well within the peer timeout plus the op timeout."""
    c = cluster(peer_timeout=2.0, op_timeout=30.0)
    workers = c.start_workers(fw.fault_on_schedule, 6)
    for w in workers:
        for rank in w.procs:
            assert w.wait_event(rank, "warm")["scheduled"] > 0  # (on the schedule before the fault)
    for rank in (0, 1):
        workers[0].wait_event(rank, "submitted")
    started = time.monotonic()
    if victim == "daemon":
        os.kill(c.daemon_pid(1), signal.SIGKILL)
    else:
        os.kill(workers[1].procs[3].pid, signal.SIGKILL)
    results = workers[0].join(timeout=60)
    assert time.monotonic() - started < 20, "the error took longer than the peer timeout allows"
    for rank, text in results.items():
        assert "PeerDied" in text, (rank, text)
        assert ("node 1" in text or "n1" in text) if victim == "daemon" else "rank 3" in text, (rank, text)


def test_a_report_that_crossed_a_rank_death_fails_when_the_death_arrives() -> None:
    """A node reported an op (say, handed back by the schedule path) after the coordinator had
    handled a rank's death, so the coordinator's failures missed it and no node will complete it:
    the node fails it itself when the death reaches it, naming the rank; ops of groups without
    that rank stay reported."""
    from types import SimpleNamespace

    from commd.core.placement import GroupPlacement
    from commd.fabric.collectives import Collectives
    from commd.observe.stats import FabricStats
    from commd.protocol import schema as s

    failed: list[tuple[list, str, str]] = []
    node = SimpleNamespace(fail_op=lambda subs, code, message: failed.append((list(subs), code, message)))
    runner = SimpleNamespace(peer_timeout=2.0)
    collectives = Collectives(node, SimpleNamespace(node_rank=0), FabricStats(), runner, lambda m: None,
                              lambda nodes: None)
    world = GroupPlacement("world", (0, 1, 2, 3), (0, 0, 1, 1), 0)
    pair = GroupPlacement("pair", (0, 2), (0, 1), 0)
    for group, seq, placement in (("world", 6, world), ("pair", 1, pair)):
        op = SimpleNamespace(group=group, seq=seq, subs=[f"{group}-sub"], describe=lambda g=group, q=seq:
                             f"allreduce #{q} on group '{g}'")
        collectives.negotiating[(group, seq)] = (op, placement, ())
    collectives.fail_rank(3, "(pid 99) died")
    assert failed == [(["world-sub"], s.E_PEER_DIED, "allreduce #6 on group 'world' cannot run: rank 3 (pid 99) died")]
    assert list(collectives.negotiating) == [("pair", 1)]


def test_a_release_that_arrives_while_this_nodes_schedule_still_runs_waits_for_its_end() -> None:
    """The coordinator numbers what it held back after the slots of the first node that ended the
    schedule; on another node the agreement that ends it may still wait to run (queued, or half done
    on the event loop).  A release that arrives then must run after it, not take the tcp stream
    first (that put the stream out of step: "node 0 runs 'agree', this node 'broadcast'")."""
    from types import SimpleNamespace

    from commd.fabric.collectives import Collectives
    from commd.observe.stats import FabricStats
    from commd.protocol import fabric as wire

    runner = SimpleNamespace(peer_timeout=2.0)
    sent: list = []
    collectives = Collectives(SimpleNamespace(), SimpleNamespace(node_rank=1), FabricStats(), runner, sent.append,
                              lambda nodes: None)
    ran: list = []
    collectives._released = ran.append  # the single release's runner: record instead of running
    path = collectives.scheduled
    path.schedule = SimpleNamespace(epoch=2, group="old", order=10, slots=[None])
    path.active, path.stopping, path.inflight, path.next_slot = True, True, 1, 3  # its ending slot still runs
    go = wire.Go("joint", 0, None, "tcp", None, None)
    collectives.run_released([go])
    assert ran == [] and sent == []
    path.inflight = 0
    path._maybe_end()  # the ending slot is back: the schedule ends here
    assert [type(m).__name__ for m in sent] == ["ScheduleEnded"] and ran == [go]
    collectives.run_released([go])  # no schedule now: at once
    assert ran == [go, go]
