"""Deadlock stress: seeded random programs on simulated hosts, every result checked.

Every op kind, random groups (spanning random nodes, random rank order),
random sizes, a random lane per op, async handles waited in random order,
random delays in the ranks and (COMMD_CHAOS_DELAY_MS) in the daemons' lanes.
`make test` runs one program; `make stress` runs many
(STRESS_PROGRAMS, STRESS_HOSTS, STRESS_LENGTH, STRESS_SEED, STRESS_MPI=1 to add
the MPI lane with daemons started by mpiexec).
"""

from __future__ import annotations

import os
import time

import pytest
import stress_program
from cluster import Cluster

from commd.sim.hosts import netns_unavailable

pytestmark = pytest.mark.extended  # make test-extended (CI runs it after make test)

PROGRAMS = int(os.environ.get("STRESS_PROGRAMS", "1"))
HOSTS = int(os.environ.get("STRESS_HOSTS", "3"))
LENGTH = int(os.environ.get("STRESS_LENGTH", "24"))
FIRST_SEED = int(os.environ.get("STRESS_SEED", "1"))
#: STRESS_MPI=1: daemons start under mpiexec and the mpi lane joins the random choice.
MPI = os.environ.get("STRESS_MPI", "0") == "1"


@pytest.mark.timeout(max(900, 180 + 60 * PROGRAMS))
def test_random_programs_finish_and_match_numpy(sim_hosts, tmp_path, monkeypatch) -> None:
    hosts = sim_hosts(HOSTS) if netns_unavailable() is None else None
    if hosts is None:
        print("network namespaces unavailable: nodes are loopback processes instead")
    monkeypatch.setenv("COMMD_CHAOS_DELAY_MS", "20")
    monkeypatch.setenv("COMMD_CHAOS_SEED", str(FIRST_SEED))
    lanes = ["tcp", "gloo"] + (["mpi"] if MPI else [])
    cluster = Cluster(tmp_path, HOSTS, 2, hosts=hosts, op_timeout=120, mpi=MPI)
    try:
        cluster.start()
        seeds = list(range(FIRST_SEED, FIRST_SEED + PROGRAMS))
        bound = 120 + 60 * PROGRAMS
        started = time.monotonic()
        workers = cluster.start_workers(stress_program.run_programs, seeds, lanes, LENGTH, 30.0)
        results = cluster.join(workers, timeout=bound)
        elapsed = time.monotonic() - started
        print(f"{PROGRAMS} programs x {LENGTH} ops on {HOSTS} hosts x 2 ranks: {elapsed:.1f}s")
        for line in results[0]:
            print(" ", line)
        assert all(len(lines) == PROGRAMS for lines in results.values())
        paths = [cluster.status(node)["fabric"]["paths"] for node in range(HOSTS)]
        print(f"ops across nodes per path, node by node: {paths}")
        assert all(p["scheduled"] > 0 for p in paths), paths  # the programs' loops ran on the schedule path
    finally:
        cluster.stop()
        print(cluster.logs(15))
