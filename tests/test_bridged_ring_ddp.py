"""DDP on bridged exchange rings: the user's path across nodes, on either bridge (COMMD_RING_BRIDGE).

DDP's buckets are kept under 64 KiB, so every gradient all-reduce takes the group's bridged ring.
The parameters after a few steps must equal a single process's (ft_workers' reference); then a rank
of node 1 dies in a backward pass, after the later layers' buckets went out, and every other rank's
backward must raise an error naming the peer's death well before the op timeout: the error reaches
DDP, not just ``wait()``.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
from cluster import free_port
from ft_workers import DDP_KWARGS, LR, MOMENTUM, batch, loss_of, mlp, reference_with_members

from commd.client.fastring import available

pytestmark = pytest.mark.skipif(not available(), reason="exchange rings need x86-64 Linux")

STEPS = 4
OP_TIMEOUT_S = 60.0


def ddp_then_a_death(ctx: Any, port: int, bridge: str, dies: int) -> str:
    """``STEPS`` DDP steps of ``mlp`` (parameters sent as the event "trained"); then rank ``dies``
    exits in the next backward, once its first layer's gradient is computed."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import commd  # noqa: F401 - registers the backend

    os.environ["COMMD_RING_BRIDGE"] = bridge
    os.environ["COMMD_JOB"] = ctx.job
    dist.init_process_group("commd", init_method=f"tcp://127.0.0.1:{port}", rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=OP_TIMEOUT_S))
    model = DistributedDataParallel(mlp(), **DDP_KWARGS)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(STEPS):
        optimizer.zero_grad()
        loss_of(model, batch(step, ctx.rank)).backward()
        optimizer.step()
    ctx.event("trained", [p.detach().tolist() for p in model.parameters()])
    ctx.command()  # the test has read the daemons' status
    if ctx.rank == dies:
        model.module[0].weight.register_hook(lambda grad: os._exit(3))
    optimizer.zero_grad()
    started = time.monotonic()
    try:
        loss_of(model, batch(STEPS, ctx.rank)).backward()
        return "no error"
    except RuntimeError as exc:  # DDP's wrapping of the backend's error
        return f"{type(exc).__name__} after {time.monotonic() - started:.1f}s: {exc}"


#: (who bridges, the rank that dies): rank 2 is node 1's first rank, which bridges node 1's part
#: of the ring when the ranks bridge; rank 3 is a plain member there.
CASES = [("daemon", 3), ("rank", 2), ("rank", 3)]


@pytest.mark.extended  # 2 daemons and 4 ranks each: make test-extended
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("bridge", "dies"), CASES)
def test_ddp_trains_as_one_process_on_the_bridge_and_a_death_fails_every_ranks_backward(
        cluster: Any, bridge: str, dies: int) -> None:
    c = cluster(2, 2, op_timeout=OP_TIMEOUT_S)
    workers = c.start_workers(ddp_then_a_death, free_port(), bridge, dies)
    trained = {r: w.wait_event(r, "trained", 150) for w in workers for r in w.procs}
    expected = reference_with_members(STEPS, {0: [0, 1, 2, 3]})
    for rank, params in trained.items():
        for got, want in zip(params, expected, strict=True):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6, msg=f"rank {rank}")
    buckets = 0
    for i in range(2):  # every bucket took the bridged ring, bridged by ``bridge``
        rings = c.status(i)["fabric"]["bridged_rings"]
        assert rings and {row["host"] for row in rings.values()} == {bridge}, rings
        buckets = max(buckets, *(row["ops"] for row in rings.values()))
    # DDP's first step sends one bucket (its first bucket may hold 1 MiB), the later ones two
    assert buckets >= 1 + 2 * (STEPS - 1), f"the buckets did not take the bridged ring: {buckets} ops"
    for w in workers:
        for r in w.procs:
            w.send(r, "go on")
    ended: dict[int, Any] = {}
    for w in workers:  # the rank that died has no result
        ended.update(w.join(150, ranks=[r for r in w.procs if r != dies]))
    for rank in sorted(set(range(4)) - {dies}):
        out = ended[rank]
        assert out.startswith("RuntimeError") and "PeerDiedError" in out, (rank, out)
        assert float(out.split(" after ")[1].split("s:")[0]) < 30, (rank, out)  # not the 60 s op timeout
        # the dead rank, not its node-mate that left after its ring saw the death
        assert f"rank {dies}" in out.split(chr(10))[0], (rank, out)
