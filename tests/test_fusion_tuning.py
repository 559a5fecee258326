"""Fusion of small all-reduces and the tuning table, on a 2-node fabric (loopback daemons).

Fusion must not change a single bit of any result: the same seeded burst runs
with fusion on and off and the results are compared byte for byte (and each
run against NumPy in the workers).  The tuning table must steer the lane
choice, show in `commd status`, and be refused with a clear reason when it
was measured on another fabric.
"""

from __future__ import annotations

import json
from pathlib import Path

import fabric_workers as fw
import pytest
from cluster import Cluster

from commd.cli.status import format_status, human_bytes
from commd.scheduler.tuning import TuningTable

pytestmark = pytest.mark.extended  # make test-extended (CI runs it after make test)


def _burst(c: Cluster, lane: str, seed: int, count: int) -> dict[int, list[str]]:
    results = c.join(c.start_workers(fw.fused_burst, lane, seed, count), timeout=120)
    return {rank: value["results"] for rank, value in results.items()}


# gloo: the same check on the second lane, 20 s on 2 cores: make test-all
@pytest.mark.parametrize("lane", ["tcp", pytest.param("gloo", marks=pytest.mark.slow)])
def test_fused_results_are_bit_identical_to_unfused(cluster, lane: str) -> None:
    fused = cluster(extra=["--fusion-cycle-ms", "2"])
    with_fusion = _burst(fused, lane, seed=11, count=120)
    fusion = fused.status(0)["fabric"]["fusion"]
    assert fusion["sets"] > 0 and fusion["ops"] > fusion["sets"], fusion
    assert fused.status(1)["fabric"]["fusion"]["sets"] == fusion["sets"]  # every node ran the same sets
    fused.stop()

    plain = cluster(extra=["--fusion-threshold", "0"])
    without = _burst(plain, lane, seed=11, count=120)
    assert plain.status(0)["fabric"]["fusion"]["sets"] == 0
    assert with_fusion == without


def test_status_counts_ops_and_bytes_per_kind_and_lane(cluster) -> None:
    c = cluster()
    assert set(c.join(c.start_workers(fw.every_op, ["tcp", "gloo"], [5])).values()) == {"ok"}
    status = c.status(0)
    by_kind = status["ops_by_lane"]
    assert by_kind["allreduce"]["tcp"]["ops"] > 0 and by_kind["allreduce"]["gloo"]["ops"] > 0
    assert by_kind["allreduce"]["tcp"]["bytes"] > 0
    assert by_kind["broadcast"]["gloo"]["ops"] > 0
    text = format_status(status)
    assert "ops per kind and lane" in text and "fusion: up to 64.0 KiB" in text, text
    row = next(line for line in text.splitlines() if line.strip().startswith("allreduce"))
    tcp = by_kind["allreduce"]["tcp"]
    assert f"{tcp['ops']:,}" in row.split() and human_bytes(tcp["bytes"]) in row, row


def _table(tmp_path: Path, nodes: int, lanes: list[str], winner_small: str, winner_large: str) -> Path:
    rows = []
    for size in (1024, 1 << 20):
        for lane in lanes:
            wins = lane == (winner_small if size == 1024 else winner_large)
            rows.append({"kind": "allreduce", "nodes": nodes, "bytes": size, "lane": lane,
                         "median_us": 10.0 if wins else 50.0, "p95_us": 60.0, "busbw_gbs": 1.0})
    table = TuningTable.from_measurements({"nodes": nodes, "lanes": sorted(lanes)}, rows)
    path = tmp_path / "table.json"
    table.save(path)
    return path


def test_tuning_table_steers_the_lane_choice(cluster, tmp_path: Path) -> None:
    path = _table(tmp_path, 2, ["tcp", "gloo"], winner_small="gloo", winner_large="tcp")
    c = cluster(extra=["--tuning", str(path)])
    # no lane hint: the table decides (small all-reduces -> gloo, large -> tcp)
    assert set(c.join(c.start_workers(fw.unhinted_allreduces, [100, 200_000])).values()) == {"ok"}
    for node in (0, 1):
        status = c.status(node)
        assert "using" in status["fabric"]["tuning"], status["fabric"]["tuning"]
        by_lane = status["ops_by_lane"]["allreduce"]
        assert by_lane["gloo"]["ops"] >= 1 and by_lane["tcp"]["ops"] >= 1, by_lane
        assert by_lane["gloo"]["bytes"] == 400 * by_lane["gloo"]["ops"]  # only the small ones
    assert json.loads(path.read_text())["fabric"]["nodes"] == 2


def test_table_of_another_fabric_is_refused_with_a_reason(cluster, tmp_path: Path) -> None:
    path = _table(tmp_path, 3, ["tcp", "gloo"], winner_small="gloo", winner_large="gloo")
    c = cluster(extra=["--tuning", str(path)])
    assert set(c.join(c.start_workers(fw.unhinted_allreduces, [100])).values()) == {"ok"}
    note = c.status(0)["fabric"]["tuning"]
    assert "refused" in note and "measured on 3 nodes, this fabric has 2" in note, note
    assert set(c.status(0)["ops_by_lane"]["allreduce"]) == {"tcp"}  # the default lane
    assert "measured on 3 nodes" in c.logs(lines=500)


def test_unreadable_named_table_stops_the_daemon_with_a_clear_error(tmp_path: Path) -> None:
    import subprocess
    import sys

    bad = tmp_path / "t.json"
    bad.write_text('{"format": "commd-tuning", "version": 99}')
    proc = subprocess.run(
        [sys.executable, "-m", "commd", "daemon", "--job", "tt", "--nnodes", "2", "--node-rank", "0",
         "--rendezvous", "127.0.0.1:1", "--tuning", str(bad)],
        capture_output=True, text=True, timeout=60, env={**__import__("os").environ,
                                                          "COMMD_RUNTIME_DIR": str(tmp_path / "rt")},
    )
    assert proc.returncode == 2
    assert "format version 99 is not supported" in proc.stderr
