"""One op model on every path: the same schedules of ops and faults give the same outcomes, the
model's (tests/path_equivalence.py), whatever path runs them — the group's exchange ring or the
daemon, on one node or on a bridged ring across two — and never a value that mixes two ops.

``make test`` runs the issue's schedule on one node and on two; ``make test-extended`` (run by CI
after it) runs ``EQUIVALENCE_SCHEDULES`` random schedules (default 150) on one node, ring on and
off, and on the schedule path; ``make equivalence`` runs thousands, on every
configuration (two nodes, three ranks, staged tensors).  The issue's own schedule (a caught timeout, then a late rank)
is a regression test of its own, on every configuration.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from cluster import free_port
from path_equivalence import TIMEOUT_S, divergences, expected, run
from test_torch_backend import spawn

from commd.client.fastring import available

pytestmark = pytest.mark.skipif(not available(), reason="exchange rings need x86-64 Linux")

SCHEDULES = int(os.environ.get("EQUIVALENCE_SCHEDULES", "150"))
SEED = int(os.environ.get("EQUIVALENCE_SEED", "31"))
#: A bound on one configuration's run (a schedule takes ~10 ms, a late rank's ~1.5 s: ~50 ms on average).
RUN_LIMIT_S = 120.0 + 0.5 * SCHEDULES
#: The ring on (the default path of small all-reduces) and off (everything through the daemon).
RING = {"ring": "1", "daemon": "0"}
#: Across nodes: the bridged ring, bridged by the daemons (the default) or by each node's first
#: rank, and everything through the daemons — (COMMD_LOCAL_RING, COMMD_RING_BRIDGE).
TWO_NODES = {"ring": ("1", "daemon"), "ring, rank bridge": ("1", "rank"), "daemon": ("0", "daemon")}
#: One node's configurations: (ranks, environment).  ``make test`` runs the first two; ``make
#: equivalence`` (EQUIVALENCE_ALL=1) all: three ranks, and tensors staged through the arena instead
#: of registered (COMMD_REGISTER=0).
ONE_NODE = {
    "ring": (2, {"COMMD_LOCAL_RING": "1"}),
    "daemon": (2, {"COMMD_LOCAL_RING": "0"}),
    "ring, 3 ranks": (3, {"COMMD_LOCAL_RING": "1"}),
    "daemon, 3 ranks": (3, {"COMMD_LOCAL_RING": "0"}),
    "ring, staged": (2, {"COMMD_LOCAL_RING": "1", "COMMD_REGISTER": "0"}),
    "daemon, staged": (2, {"COMMD_LOCAL_RING": "0", "COMMD_REGISTER": "0"}),
}
EVERY_CONFIG = os.environ.get("EQUIVALENCE_ALL") == "1"


def _ar(value: float) -> str:
    """One all-reduce of ten ``value``s: its result, or the error it raised (class name)."""
    x = torch.full((10,), float(value))
    try:
        dist.all_reduce(x)
        return f"returned {x[0].item():g}"
    except Exception as exc:  # the outcome is the point
        return f"raised {type(exc).__name__}: {exc}"


def issue_schedule(rank: int) -> list[str]:
    """Rank 0's op A times out and is caught; rank 1's op A arrives after it (late); then op B on both.
    A late op must fail on arrival, never meet the other rank's op B (the sum of two steps' tensors)."""
    t = torch.ones(10)
    dist.all_reduce(t)
    outcomes = []
    if rank == 0:
        outcomes.append(_ar(1))
        time.sleep(1.25 * TIMEOUT_S)
        outcomes.append(_ar(100))
    else:
        time.sleep(2.0 * TIMEOUT_S)
        started = time.monotonic()
        outcomes.append(_ar(2))
        outcomes.append(f"{time.monotonic() - started:.3f}")
        outcomes.append(_ar(200))
    return outcomes


def _check_issue_schedule(results: dict[int, list[str]]) -> None:
    a0, b0 = results[0]
    a1, seconds, b1 = results[1]
    for rank, outcome in ((0, a0), (1, a1)):
        assert outcome.startswith("raised CommTimeoutError") and "#1 on group" in outcome, (rank, outcome)
        assert "(global ranks [1])" in outcome, (rank, outcome)
    assert float(seconds) < TIMEOUT_S / 2, f"the late op waited {seconds}s instead of failing on arrival"
    assert b0 == b1 == "returned 300", results


def one_node_rank_main(rank: int, out_dir: str, env: dict[str, str], world: int, what: str) -> None:
    import commd  # noqa: F401 - registers the backend

    os.environ.update(env)
    dist.init_process_group("commd", init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S))
    try:
        result: Any = issue_schedule(rank) if what == "issue" else run(rank, world, SEED, SCHEDULES, dist, torch)
        Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


#: Across nodes the schedules run on a new group every this many: a bridged ring is left at its
#: group's first fault, and each new group gets one again.
GROUP_EVERY = 10


#: The schedule path's configuration: schedules in blocks of this many alike (tests/path_equivalence.py).
REPEAT = 4


def two_node_main(ctx: Any, port: int, ring: str, what: str, repeat: int = 1, bridge: str = "rank") -> str:
    import commd  # noqa: F401 - registers the backend

    os.environ["COMMD_LOCAL_RING"] = ring
    os.environ["COMMD_RING_BRIDGE"] = bridge
    os.environ["COMMD_JOB"] = ctx.job
    dist.init_process_group("commd", init_method=f"tcp://127.0.0.1:{port}", rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=TIMEOUT_S))
    try:
        result: Any = (issue_schedule(ctx.rank) if what == "issue"
                       else run(ctx.rank, ctx.world_size, SEED, SCHEDULES, dist, torch, GROUP_EVERY, repeat))
        dist.barrier()
        return json.dumps(result)
    finally:
        dist.destroy_process_group()


def _one_node(tmp_path: Path, config: str, what: str) -> dict[int, Any]:
    world, env = ONE_NODE[config]
    spawn(one_node_rank_main, (str(tmp_path), env, world, what), timeout=RUN_LIMIT_S, nprocs=world)
    return {r: json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)}


def _two_nodes(cluster: Any, ring: str, what: str, repeat: int = 1, nodes: int = 2,
               bridge: str = "rank") -> dict[int, Any]:
    c = cluster(nodes, 1, op_timeout=TIMEOUT_S)
    results = c.join(c.start_workers(two_node_main, free_port(), ring, what, repeat, bridge), timeout=RUN_LIMIT_S)
    out = {r: json.loads(value) for r, value in results.items()}
    if isinstance(out[0], dict):
        out[0]["paths"] = [c.status(node)["fabric"]["paths"] for node in range(nodes)]
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.extended) if p == "daemon" else p
                                  for p in sorted(RING)])  # (the non-default path: make test-extended)
def test_the_issue_schedule_on_one_node(backend_env: Any, tmp_path: Path, path: str) -> None:
    _check_issue_schedule(_one_node(tmp_path, path, "issue"))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.extended) if p != "ring" else p
                                  for p in TWO_NODES])  # (all but the default path: make test-extended)
def test_the_issue_schedule_across_two_nodes(cluster: Any, path: str) -> None:
    ring, bridge = TWO_NODES[path]
    _check_issue_schedule(_two_nodes(cluster, ring, "issue", bridge=bridge))


def _check_equivalence(results: dict[int, Any], where: str, path: str, group_every: int | None = None,
                       repeat: int = 1) -> None:
    world = len(results)
    want = expected(SEED, SCHEDULES, world, group_every, repeat)
    problems = []
    for rank in range(world):
        got = results[rank]
        problems += [f"rank {rank}: {line}" for line in
                     divergences(got["outcomes"], got["groups"], want[rank], SEED, SCHEDULES, world, repeat)]
    print(f"{where}, {path}: {SCHEDULES} schedules, {len(want[0])} ops a rank, "
          f"{results[0]['on_ring']} of rank 0's all-reduces on the ring, {results[0]['seconds']:.1f}s")
    assert not problems, f"{len(problems)} outcomes differ from the model:\n" + "\n".join(problems[:20])
    if path == "schedule":
        assert all(p["scheduled"] > 0 and p["fallback"] > 0 for p in results[0]["paths"]), results[0]["paths"]
    elif path.startswith("ring"):
        assert results[0]["on_ring"] > 0, "no op took the ring: the ring path was not tested"
    else:
        assert results[0]["on_ring"] == 0


@pytest.mark.extended  # make test-extended, make equivalence (CI runs both after make test)
@pytest.mark.timeout(RUN_LIMIT_S + 60)
@pytest.mark.parametrize("path", list(ONE_NODE) if EVERY_CONFIG else sorted(RING))
def test_random_schedules_give_the_model_outcomes_on_one_node(backend_env: Any, tmp_path: Path, path: str) -> None:
    _check_equivalence(_one_node(tmp_path, path, "schedules"), "one node", path)


@pytest.mark.slow  # make equivalence, make test-all (make test-extended: one node and the schedule path)
@pytest.mark.timeout(RUN_LIMIT_S + 60)
@pytest.mark.parametrize("path", list(TWO_NODES))
def test_random_schedules_give_the_model_outcomes_across_two_nodes(cluster: Any, path: str) -> None:
    ring, bridge = TWO_NODES[path]
    _check_equivalence(_two_nodes(cluster, ring, "schedules", bridge=bridge), "two nodes", path, GROUP_EVERY)


@pytest.mark.extended  # make test-extended (CI runs it after make test)
@pytest.mark.timeout(RUN_LIMIT_S + 60)
@pytest.mark.parametrize("nodes", [2, 3])
def test_random_schedules_give_the_model_outcomes_on_the_schedule_path(cluster: Any, nodes: int) -> None:
    """Across nodes through the daemons, the schedules in blocks that repeat: the fabric's schedule
    path runs them (counted on every node), and the faults in each block's last schedule make it
    leave the path: mismatches, another kind, a late rank — every outcome the model's.  On 3 nodes
    a tiny all-reduce's contributions ride its gathered agreement."""
    _check_equivalence(_two_nodes(cluster, "0", "schedules", REPEAT, nodes), f"{nodes} nodes", "schedule",
                       GROUP_EVERY, REPEAT)
