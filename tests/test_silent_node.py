"""A node that falls silent (SIGSTOP of its daemon and ranks: a hung host, a pulled cable) in the
middle of ops on the daemons' path, a member or the coordinator: the other node's ranks must fail
at the peer timeout, as the node's death (PeerDiedError naming the verdict), not wait out the op's
timeout and then fail as a timeout, which a commd.ft guard would not recover from.

The ops are 1 MiB all-reduces, on the schedule path once their pattern repeats: node 0's daemon
sends its part of each slot's agreement and waits on its event loop for node 1's, which a silent
node never sends, nor does it close the connection.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from cluster import free_port

from commd.client.errors import CommdError

PEER_TIMEOUT_S = 2.0
OP_TIMEOUT_S = 60.0
WARM_OPS = 24
COUNT = 1 << 18  # 1 MiB of float32: the daemons' path, not the exchange ring


def reduce_until_silence(ctx: Any, port: int, silent: list[int]) -> str:
    import commd  # noqa: F401 - registers the backend

    os.environ["COMMD_JOB"] = ctx.job
    dist.init_process_group("commd", init_method=f"tcp://127.0.0.1:{port}", rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=OP_TIMEOUT_S))
    x = torch.empty(COUNT)
    for i in range(WARM_OPS):
        x.fill_(ctx.rank + i)
        dist.all_reduce(x)
        assert torch.equal(x, torch.full((COUNT,), float(sum(r + i for r in range(ctx.world_size))))), i
    ctx.event("warm", os.getpid())
    if ctx.rank in silent:
        ctx.command()  # (stopped meanwhile; never answered)
    started = time.monotonic()
    try:
        for _ in range(100):
            dist.all_reduce(x)
        return "no error"
    except CommdError as exc:
        return f"{type(exc).__name__} after {time.monotonic() - started:.1f}s: {exc}"


#: (the node that falls silent, what the other node's ranks' error must say): a member, declared
#: dead by the coordinator; or the coordinator itself, given up by the member.
SILENT = [(1, "node 1 (n1) has not been heard from"), (0, "the coordinator (node 0, n0) has not been heard from")]


@pytest.mark.extended  # 2 daemons, 4 ranks and a peer timeout: make test-extended
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("silent_node", "verdict"), SILENT)
def test_a_silent_node_fails_the_other_nodes_scheduled_ops_at_the_peer_timeout_as_a_death(
        cluster: Any, silent_node: int, verdict: str) -> None:
    c = cluster(2, 2, peer_timeout=PEER_TIMEOUT_S, op_timeout=OP_TIMEOUT_S)
    silent = [2 * silent_node, 2 * silent_node + 1]
    workers = c.start_workers(reduce_until_silence, free_port(), silent)
    pids = {r: w.wait_event(r, "warm", 120) for w in workers for r in w.procs}
    assert c.status(0)["fabric"]["paths"]["scheduled"] > 0, c.status(0)["fabric"]["paths"]
    node = [c.daemon_pid(silent_node)] + [pids[r] for r in silent]
    for pid in node:
        os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        results = workers[1 - silent_node].join(timeout=OP_TIMEOUT_S)
        waited = time.monotonic() - stopped
    finally:
        for pid in node:
            os.kill(pid, signal.SIGCONT)
    for rank, out in results.items():
        assert out.startswith("PeerDiedError"), (rank, out)
        assert verdict in out, (rank, out)
    assert waited < PEER_TIMEOUT_S + 8, f"the other node's ranks waited {waited:.1f}s (peer timeout {PEER_TIMEOUT_S}s)"
