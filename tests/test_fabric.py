"""Multi-node jobs: daemons on loopback with distinct node names form a fabric.

Each test starts 2 nodes x 2 ranks (daemons + workers as separate processes)
and checks results against NumPy references computed in the workers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fabric_workers as fw
import pytest
from cluster import Cluster
from helpers import wait_until

from commd.cli.status import format_status


def test_every_op_on_tcp_and_gloo_lanes(cluster) -> None:
    c = cluster()
    results = c.join(c.start_workers(fw.every_op, ["tcp", "gloo"], [5, 70_000]), timeout=240)
    assert set(results.values()) == {"ok"}
    status = c.status(0)
    fabric = status["fabric"]
    assert fabric["coordinator"] and [n["name"] for n in fabric["nodes"]] == ["n0", "n1"]
    assert fabric["lane_ops"]["tcp"]["ops"] > 0 and fabric["lane_ops"]["gloo"]["ops"] > 0
    # the same collective pattern repeats: later reports take the cached fast path
    assert c.status(1)["fabric"]["fast_path"] > 0


@pytest.mark.extended  # several processes, ~10 s: make test-extended (CI runs it too)
def test_mismatch_across_nodes_names_fields_and_ranks(cluster) -> None:
    c = cluster()
    results = c.join(c.start_workers(fw.mismatch))
    for rank, value in results.items():
        message = value["message"]
        assert "'count' differs" in message, (rank, message)
        assert "ranks [0, 1] 8" in message and "ranks [2, 3] 9" in message, message


@pytest.mark.extended
def test_stall_shows_missing_rank_in_status(cluster, tmp_path: Path) -> None:
    config = tmp_path / "commd.toml"
    config.write_text("[scheduler]\nstall_warning_s = 0.5\n")
    c = cluster(extra=["--config", str(config)])
    workers = c.start_workers(fw.stall)
    for w in workers:
        for rank in w.procs:
            if rank != 3:
                w.wait_event(rank, "submitted")
    workers[1].wait_event(3, "ready")

    def stalled() -> list:
        rows = c.status(0)["stalls"]
        return [r for r in rows if r.get("missing_ranks") == [3]]

    rows = wait_until(stalled, 30, "the stall to show rank 3 in node 0's status")
    assert rows[0]["kind"] == "allreduce" and rows[0]["missing_nodes"] == [1]
    # the CLI shows it too
    out = subprocess.run(
        [sys.executable, "-m", "commd", "status", "--job", c.job], capture_output=True, text=True, timeout=60,
        env=dict(os.environ, COMMD_RUNTIME_DIR=str(c.runtime[0])),
    )
    assert "stall" in out.stdout.lower() and "3" in out.stdout, out.stdout + out.stderr
    workers[1].send(3, "go")
    assert set(c.join(workers).values()) == {"ok"}


def test_dead_node_fails_ops_instead_of_hanging(cluster) -> None:
    c = cluster(peer_timeout=2.0)
    workers = c.start_workers(fw.hang_on_dead_node)
    for w in workers:
        for rank in w.procs:
            w.wait_event(rank, "first-done")
    os.kill(c.daemon_pid(1), signal.SIGKILL)
    for rank in (0, 1):
        workers[0].send(rank, "go")
    started = time.monotonic()
    results = workers[0].join(timeout=60)
    assert time.monotonic() - started < 45
    for rank, text in results.items():
        assert "PeerDied" in text or "Timeout" in text, (rank, text)
        assert "node 1" in text or "n1" in text, text


@pytest.mark.slow  # 12 s: make test-all (every op across simulated hosts also runs in test_stress.py)
def test_every_op_between_simulated_hosts_with_shaped_links(sim_hosts, tmp_path: Path) -> None:
    """Two network namespaces joined by a bridge, links at 10 Gbit/s with 0.1 ms delay."""
    hosts = sim_hosts(2, delay_ms=0.1, rate="10gbit")
    c = Cluster(tmp_path, 2, 2, hosts=hosts)
    try:
        c.start()
        assert [n["ip"] for n in c.status(0)["fabric"]["nodes"]] == [h.ip for h in hosts.hosts]
        results = c.join(c.start_workers(fw.every_op, ["tcp", "gloo"], [300]), timeout=240)
        assert set(results.values()) == {"ok"}
    finally:
        c.stop()
        print(c.logs())


def test_node_that_shuts_down_is_known_dead_at_once(cluster) -> None:
    """SIGTERM on node 1's daemon: node 0 marks it dead right away (no peer timeout to wait out)."""
    c = cluster(peer_timeout=60.0)
    c.procs[1].terminate()
    c.procs[1].wait(timeout=30)

    def dead() -> bool:
        nodes = c.status(0)["fabric"]["nodes"]
        return not nodes[1]["alive"]

    wait_until(dead, 15, "node 0 to see node 1 leave")
    errors = " ".join(e["message"] for e in c.status(0)["last_errors"]) + c.logs()
    assert "left the fabric" in errors


@pytest.mark.extended  # ~20 s: make test-extended
def test_tiny_allreduces_complete_on_node_0s_early_contribution(cluster) -> None:
    """Node 0 reports first: node 1 combines node 0's early contribution itself (counted), results
    stay right, and a mismatch among cached patterns still fails on every rank.  Then every
    reduce op and dtype on the same fabric (one fabric start for both)."""
    c = cluster()
    assert set(c.join(c.start_workers(fw.early_tiny_allreduces, 6)).values()) == {"ok"}
    assert set(c.join(c.start_workers(fw.reduce_ops_and_dtypes, "tcp")).values()) == {"ok"}
    fabric = c.status(1)["fabric"]
    assert fabric["completed_early"] >= 1, fabric
    assert c.status(0)["fabric"]["completed_early"] == 0  # node 0 always waits for the release


@pytest.mark.extended
def test_large_buffers_use_parallel_local_phases(cluster) -> None:
    c = cluster()
    assert set(c.join(c.start_workers(fw.large_ops, "tcp")).values()) == {"ok"}


@pytest.mark.extended
def test_rules_choose_a_codec_for_broadcasts_that_name_none(cluster, tmp_path: Path) -> None:
    """Node 0's [[compression]] rules (bf16, then lossless, broadcasts from 1 MiB) reach the
    coordinator: a broadcast that names no codec runs with lossless (the root's bits), one with
    "auto" with bf16 (its rounding, the same bits on every rank), "auto" on int64 with lossless,
    "none" and a small one plain; status counts what ran compressed on both nodes."""
    config = tmp_path / "commd.toml"
    config.write_text('[[compression]]\ncodec = "bf16"\nkind = "broadcast"\nmin_bytes = 1048576\n\n'
                      '[[compression]]\ncodec = "lossless"\nkind = "broadcast"\nmin_bytes = 1048576\n')
    c = cluster(extra=["--config", str(config)])
    results = c.join(c.start_workers(fw.chosen_codecs))
    for name in ("default", "auto", "int64", "none", "small"):
        assert len({outcome[name] for outcome in results.values()}) == 1, name
    for node in (0, 1):
        rows = c.status(node)["fabric"]["compression"]
        assert set(rows) == {"bf16", "lossless"}, rows
        assert rows["lossless"]["ops"] == 2 and rows["bf16"]["ops"] == 1, rows  # default + int64; auto
        assert rows["bf16"]["raw_bytes"] == 400_003 * 4 and rows["bf16"]["ratio"] < 0.5, rows
        assert "compressed ops, bf16: 1" in format_status(c.status(node))


@pytest.mark.extended
def test_compressed_broadcasts_across_nodes_and_their_status(cluster) -> None:
    """Every codec end to end through the client library on 2 nodes x 2 ranks (checked in the workers
    against the root's data or torch's rounding), and compressed all-gathers; disagreements fail
    every rank; status counts it."""
    c = cluster()
    results = c.join(c.start_workers(fw.compressed_broadcasts))
    for rank, outcome in results.items():
        assert "'codec' differs" in outcome["disagree"] and "'bf16'" in outcome["disagree"], (rank, outcome)
        assert "lossless" in outcome["disagree"], (rank, outcome)
        assert "codec 'bf16' does not take int64" in outcome["dtype"], (rank, outcome)
    for node in (0, 1):
        rows = c.status(node)["fabric"]["compression"]
        assert set(rows) == {"bf16", "lossless", "bf16-cast", "lossless-zstd", "fp16"}, rows
        assert all(row["ops"] == 1 and row["raw_bytes"] == 400_003 * 4  # one broadcast: sent or received once
                   for name, row in rows.items() if name not in ("bf16", "lossless")), rows
        assert rows["bf16"]["ops"] == rows["lossless"]["ops"] == 3, rows  # a broadcast, an all-gather, an all-reduce
        assert rows["bf16"]["ratio"] < 0.45 and rows["bf16-cast"]["ratio"] == 0.5, rows
        assert "compressed ops, bf16: 3 (broadcasts, all-gathers, all-reduces)" in format_status(c.status(node))
    for codec in ("lossless", "bf16"):  # every rank's all-reduce result has the same bits
        assert len({outcome[f"allreduce-{codec}"] for outcome in results.values()}) == 1, codec
