"""commd.ft when the coordinator dies: node 0's daemon is the fabric's coordinator, and commd has no
takeover, so every rank must fail fast with an error that says so; no rank may report a recovery.

2 simulated nodes x 2 ranks train under ``commd.ft.Guard``, the job's store hosted by the test (as a
launcher's or torchrun's agent would: the store outlives node 0).  At step 3, node 0's ranks wait
before their forward while node 1's are in that step's all-reduces; then node 0's daemon is SIGKILLed
and node 0's ranks go on ("daemon"), or node 0's daemon and ranks are all SIGKILLed ("node"), or node 0's
ranks are SIGKILLed and its daemon SIGSTOPped ("frozen": a silent coordinator, known to node 1 only by
its peer timeout, 2 s here, instead of a closed connection).  Node 1's ranks must end with an error
naming the coordinator (node 0) within ``FAIL_FAST_S`` of the kill, and node 0's surviving ranks (whose
daemon is gone) with an error too.

Node 1's daemon knows at once (closed connection) or after the peer timeout, and says so in its
status (``fabric.broken``); the guard reads it there.  Before it did, node 1's ranks polled their
daemon's list of gone ranks (empty: a lost coordinator marks no rank gone) for the whole recovery
timeout, then waited on the store for a group of all four ranks: about 120 s, and an error that
named neither the coordinator nor node 0.
"""

from __future__ import annotations

import os
import re
import signal
import time
from datetime import timedelta

import pytest
import torch

pytestmark = [pytest.mark.extended, pytest.mark.timeout(240)]

STEPS = 6
PAUSE_STEP = 3
#: How soon after the coordinator's death every rank of node 1 must have failed.
FAIL_FAST_S = 20.0
#: How long the test waits for the ranks at all (longer than the bound, to see what happens instead).
JOIN_S = 100.0
#: A rank still running this long after its start prints its stacks (to see where it hangs).
DUMP_AFTER_S = 75.0


@pytest.mark.parametrize("victim", ["daemon", "node", "frozen"])
def test_the_coordinators_death_fails_every_rank_fast_with_an_error_naming_it(cluster, victim: str) -> None:
    import ft_workers as fw

    c = cluster(2, 2, peer_timeout=2.0, op_timeout=30.0)
    store = torch.distributed.TCPStore("127.0.0.1", 0, c.world, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=JOIN_S))
    workers = c.start_workers(fw.ft_coordinator_death, store.port, STEPS, PAUSE_STEP, [0, 1], DUMP_AFTER_S)
    for rank in range(c.world):
        workers[c.node_of(rank)].wait_event(rank, "at pause step")
    time.sleep(0.5)  # node 1's ranks are in step 3's all-reduces, waiting for node 0's
    coordinator = c.daemon_pid(0)
    os.kill(coordinator, signal.SIGSTOP if victim == "frozen" else signal.SIGKILL)
    killed_at = time.time()
    try:
        for rank in (0, 1):
            if victim == "daemon":
                workers[0].send(rank, "go")
            else:
                os.kill(workers[0].procs[rank].pid, signal.SIGKILL)
        results = {}
        results.update(workers[1].join(timeout=JOIN_S))
        if victim == "daemon":
            results.update(workers[0].join(timeout=30))
    finally:
        if victim == "frozen":
            os.kill(coordinator, signal.SIGKILL)
    seconds = {rank: round(out["at"] - killed_at, 2) for rank, out in results.items()}
    print(f"seconds from the kill to each rank's end: {seconds}")
    for rank, out in sorted(results.items()):
        print(f"rank {rank}: {out.get('error', 'finished')} (steps {out['steps']}, recoveries {out['recoveries']})")
    for rank in (2, 3):
        out = results[rank]
        assert "error" in out, (rank, out)
        assert out["recoveries"] == [], (rank, out)
        assert re.match(r"(UnrecoverableError|PeerDiedError|RuntimeError)", out["error"]), (rank, out["error"])
        assert re.search(r"coordinator \(node 0", out["error"]), (rank, out["error"])
        if victim == "frozen":  # known by the peer timeout, not a closed connection
            assert "has not been heard from" in out["error"], (rank, out["error"])
        assert seconds[rank] <= FAIL_FAST_S, (rank, seconds[rank], out["error"])
    for rank in (0, 1) if victim == "daemon" else ():  # their daemon is gone: they fail too, and never recover
        assert "error" in results[rank] and results[rank]["recoveries"] == [], (rank, results[rank])
        assert seconds[rank] <= FAIL_FAST_S, (rank, seconds[rank], results[rank]["error"])
