"""commd.ft when a node stops (SIGSTOP of its daemon and its ranks), or its link goes down, for longer
than the peer timeout, and then runs on.

The other node's daemon counts that node dead; its ranks go on without the stopped node's ranks
(their small all-reduces cross on the ranks' bridges, which the daemon tells).  When the stopped
node runs again, its ranks must not go on as a second copy of the job (a split brain that trains
two diverged models): they fail loudly, naming why.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from ft_workers import reference

STEPS, PAUSE_STEP = 6, 3
PEER_TIMEOUT_S = 2.0


def _node_0_went_on_and_node_1_gave_up(results: dict, late: dict, verdict: str) -> None:
    """Node 0's ranks trained on as one process would without node 1's from the pause; node 1's
    raised, cut off from the job (``verdict``: how their error names the coordinator's)."""
    expected = reference(STEPS, 4, PAUSE_STEP, [0, 1])
    for rank, out in results.items():
        assert "error" not in out, (rank, out)
        assert [tuple(r[:3]) for r in out["recoveries"]] == [(PAUSE_STEP, (2, 3), (0, 1))], out["recoveries"]
        for got, want in zip(out["params"], expected, strict=True):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)
    for rank, out in late.items():
        assert "error" in out, f"rank {rank} of node 1 trained on: {out.get('recoveries')}"
        assert out["error"].startswith(f"UnrecoverableError: rank {rank}'s node is cut off from the job: the "
                                       + verdict), out["error"]


@pytest.mark.extended
@pytest.mark.timeout(300)
def test_a_node_stopped_past_the_peer_timeout_is_left_behind_and_never_trains_a_second_copy(cluster) -> None:
    import ft_partition_workers as pw
    from cluster import free_port

    c = cluster(2, 2, peer_timeout=PEER_TIMEOUT_S, op_timeout=30.0)
    paused = [2, 3]
    workers = c.start_workers(pw.train_through_a_pause, free_port(), STEPS, PAUSE_STEP, paused)
    node = [c.daemon_pid(1)] + [workers[1].wait_event(rank, "at pause step") for rank in paused]
    for pid in node:  # the whole node hangs
        os.kill(pid, signal.SIGSTOP)
    try:
        for rank in paused:
            workers[1].send(rank, "go")  # (read once they run again)
        results = workers[0].join(timeout=120)
    finally:
        time.sleep(3 * PEER_TIMEOUT_S)
        for pid in node:
            os.kill(pid, signal.SIGCONT)
        resumed = time.monotonic()
    late = workers[1].join(timeout=120)
    ended = time.monotonic() - resumed
    _node_0_went_on_and_node_1_gave_up(results, late, "coordinator (node 0, n0) declared this node dead")
    assert ended < 20, f"the stopped node's ranks took {ended:.1f}s after it ran again to fail"


@pytest.mark.extended
@pytest.mark.timeout(300)
def test_a_link_down_past_the_peer_timeout_leaves_that_node_behind_and_it_never_trains_a_second_copy(
        sim_hosts, cluster) -> None:
    """The same partition made by the network: node 1's cable pulled (simulated hosts), nobody told.
    Both sides' daemons see only silence; node 0's ranks go on without node 1's, node 1's fail."""
    import ft_partition_workers as pw
    from cluster import free_port

    from commd.sim.hosts import netns_unavailable

    if (why := netns_unavailable()) is not None:
        pytest.skip(f"a link of its own per node needs simulated hosts: {why}")
    hosts = sim_hosts(2)
    c = cluster(2, 2, hosts=hosts, peer_timeout=PEER_TIMEOUT_S, op_timeout=30.0)
    paused = [2, 3]
    workers = c.start_workers(pw.train_through_a_pause, free_port(), STEPS, PAUSE_STEP, paused, hosts[0].ip)
    for rank in paused:
        workers[1].wait_event(rank, "at pause step")
    hosts.set_link(1, up=False)
    cut = time.monotonic()
    try:
        for rank in paused:
            workers[1].send(rank, "go")  # node 1 goes on into a step it cannot finish
        results = workers[0].join(timeout=120)
        late = workers[1].join(timeout=120)  # node 1's ranks must give up while cut off, not hang
        gave_up = time.monotonic() - cut
    finally:
        hosts.set_link(1, up=True)
    _node_0_went_on_and_node_1_gave_up(results, late, "coordinator (node 0, ")
    assert gave_up < 20, f"the cut-off node's ranks took {gave_up:.1f}s to give up"
