"""The tuning table, the lane choice that consults it, and the coordinator's fusion marks (pure logic)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_coordinator import LANES, entry, ready, sent

from commd.scheduler.config import LaneRule, SchedulerConfig
from commd.scheduler.coordinator import Coordinator, Outbox
from commd.scheduler.selection import choose_lane
from commd.scheduler.tuning import TuningTable, default_table_path, group_class


def _rows(times: dict[int, dict[str, float]], kind: str = "allreduce", nodes: int = 2) -> list[dict]:
    return [{"kind": kind, "nodes": nodes, "bytes": size, "lane": lane, "median_us": t, "p95_us": t * 1.2,
             "busbw_gbs": size / t / 1e3}
            for size, lanes in times.items() for lane, t in lanes.items()]


def _table() -> TuningTable:
    rows = _rows({1024: {"tcp": 50.0, "gloo": 80.0}, 65536: {"tcp": 300.0, "gloo": 200.0},
                  1 << 22: {"tcp": 4000.0, "gloo": 6000.0}})
    rows += _rows({1024: {"tcp": 90.0, "gloo": 60.0}}, kind="broadcast")
    return TuningTable.from_measurements({"nodes": 2, "lanes": ["gloo", "tcp"]}, rows)


def test_winner_is_the_lowest_median_and_ranges_meet_halfway() -> None:
    table = _table()
    allreduce = [e for e in table.entries if e.kind == "allreduce"]
    assert [(e.size, e.lane) for e in allreduce] == [(1024, "tcp"), (65536, "gloo"), (1 << 22, "tcp")]
    assert allreduce[0].min_bytes == 0 and allreduce[-1].max_bytes >= 1 << 60
    for lower, upper in zip(allreduce, allreduce[1:], strict=False):
        assert upper.min_bytes == lower.max_bytes + 1  # no gap, no overlap
        assert lower.size < upper.min_bytes <= upper.size
    assert allreduce[1].measured["tcp"]["median_us"] == 300.0  # every lane's figures kept
    # sizes between two measured ones go to the geometrically nearer one
    assert table.lookup("allreduce", 2047, 2) == "tcp" and table.lookup("allreduce", 16384, 2) == "gloo"
    assert table.lookup("allreduce", 10 << 20, 2) == "tcp"


def test_kinds_without_own_entries_follow_the_kind_sharing_their_lane_primitive() -> None:
    table = _table()
    assert table.lookup("reduce", 65536, 2) == "gloo" and table.lookup("reduce_scatter", 100, 2) == "tcp"
    assert table.lookup("broadcast", 1024, 2) == "gloo"
    assert table.lookup("alltoall", 1024, 2) is None  # not measured: the caller falls back
    assert table.lookup("barrier", 0, 2) is None
    assert table.lookup("allreduce", 1024, 3) is None  # another group-size class


def test_group_classes_and_default_location(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert [group_class(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [
        "1", "2", "3-4", "3-4", "5-8", "5-8", "9-16", "9-16", "17-32"]
    monkeypatch.setenv("COMMD_TUNING_DIR", str(tmp_path))
    assert default_table_path("host0", 2) == tmp_path / "host0-2nodes.json"
    assert default_table_path("a/b", 3).name == "a_b-3nodes.json"


def test_saved_table_loads_back_and_bad_files_are_named(tmp_path: Path) -> None:
    table = _table()
    path = tmp_path / "t.json"
    table.save(path)
    loaded = TuningTable.load(path)
    assert loaded.table_id == table.table_id and loaded.entries == table.entries and loaded.source == str(path)
    raw = json.loads(path.read_text())
    raw["entries"][0]["lane"] = "mpi"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"entries\[0\]: 'lane' 'mpi' is not one of the table's lanes"):
        TuningTable.load(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="is not valid JSON"):
        TuningTable.load(path)
    with pytest.raises(ValueError, match="cannot read tuning table"):
        TuningTable.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="'median_us' must be a positive number"):
        TuningTable.from_measurements({"nodes": 2, "lanes": ["tcp"]}, [
            {"kind": "allreduce", "nodes": 2, "bytes": 8, "lane": "tcp", "median_us": 0}])


def test_fabric_check_names_the_difference() -> None:
    table = _table()
    assert table.check_fabric(2, ["tcp", "gloo"]) is None
    assert "measured on 2 nodes, this fabric has 4" in table.check_fabric(4, ["tcp", "gloo"])
    assert "lanes ['gloo', 'tcp'], this fabric has ['gloo', 'mpi', 'tcp']" in table.check_fabric(
        2, ["tcp", "gloo", "mpi"])
    config = SchedulerConfig()
    config.adopt_table(table, 3, ["gloo", "tcp"])
    assert config.table is None and "refused" in config.tuning_note and "3" in config.tuning_note


def test_grid_shows_winners_and_where_they_change() -> None:
    grid = _table().grid()
    assert "allreduce" in grid and "broadcast" in grid
    assert "allreduce tcp->gloo at 64 KiB" in grid and "allreduce gloo->tcp at 4 MiB" in grid
    line = next(x for x in grid.splitlines() if x.strip().startswith("64 KiB"))
    assert line.split()[2:] == ["gloo", "-"]  # allreduce winner; broadcast not measured there


def test_selection_order_is_hint_rules_table_default() -> None:
    config = SchedulerConfig()
    config.adopt_table(_table(), 2, ["gloo", "tcp"])
    nodes = (0, 1)

    def pick(nbytes: int, hint: str | None = None) -> str:
        return choose_lane("allreduce", "float32", "sum", nbytes, nodes, 4, hint, config, LANES)

    assert pick(65536) == "gloo" and pick(1024) == "tcp"  # the table
    assert pick(65536, hint="tcp") == "tcp"  # a hint wins
    config.rules.append(LaneRule("tcp", kind="allreduce", min_bytes=60000, max_bytes=70000))
    assert pick(65536) == "tcp"  # a config rule wins over the table
    # a table winner the lane cannot run falls through to the default
    assert choose_lane("allreduce", "bool", "sum", 65536 + 8, nodes, 4, None, SchedulerConfig(
        table=config.table), LANES) == "tcp"


def _go_items(out: Outbox, node: int = 0) -> list[dict]:
    return [m for m in sent(out)[node] if m["t"] == "go"]


def _report_both(coord: Coordinator, items0: list[dict], out: Outbox) -> None:
    coord.report(0, ready(items0), out)
    coord.report(1, ready([dict(x, mine=[2, 3]) for x in items0]), out)


def test_consecutive_small_allreduces_form_one_fused_set_up_to_the_threshold() -> None:
    coord = Coordinator(2, SchedulerConfig(fusion_threshold_bytes=64), LANES)
    out = Outbox()
    # 16-byte all-reduces: 4 fit in 64 bytes; then a broadcast ends the set; a max starts another
    items = [entry(seq=i) for i in range(6)] + [entry(seq=6, kind="broadcast", sig={"root": 0})]
    items += [entry(seq=7, sig={"reduce_op": "max"}), entry(seq=8, sig={"reduce_op": "max"})]
    coord.report(0, ready(items), Outbox())
    out = Outbox()
    coord.report(1, ready([dict(x, mine=[2, 3]) for x in items]), out)
    marks = [(m["s"], m.get("fz")) for m in _go_items(out, 0)]
    orders = {m["s"]: m["o"] for m in _go_items(out, 0)}
    assert marks == [(0, None), (1, orders[0]), (2, orders[0]), (3, orders[0]), (4, None), (5, orders[4]),
                     (6, None), (7, None), (8, orders[7])]
    assert [(m["s"], m.get("fz")) for m in _go_items(out, 1)] == marks  # identical on every node


def test_a_node_saying_no_fusion_keeps_the_op_out_of_the_set() -> None:
    coord = Coordinator(2, SchedulerConfig(), LANES)
    items = [entry(seq=0), entry(seq=1), entry(seq=2)]
    coord.report(0, ready(items), Outbox())
    out = Outbox()
    coord.report(1, ready([dict(items[0], mine=[2, 3]), dict(items[1], mine=[2, 3], nf=1),
                           dict(items[2], mine=[2, 3])]), out)
    assert [m.get("fz") for m in _go_items(out)] == [None, None, None]
    out = Outbox()
    coord2 = Coordinator(2, SchedulerConfig(fusion_threshold_bytes=0), LANES)
    _report_both(coord2, [entry(seq=0), entry(seq=1)], out)
    assert all("fz" not in m for m in _go_items(out))  # threshold 0: fusion off


def test_near_ties_keep_the_preferred_lane() -> None:
    rows = _rows({1024: {"tcp": 102.0, "gloo": 100.0}, 4096: {"tcp": 110.0, "gloo": 100.0}})
    table = TuningTable.from_measurements({"nodes": 2, "lanes": ["gloo", "tcp"]}, rows)
    assert [e.lane for e in table.entries] == ["tcp", "gloo"]  # 2% slower keeps tcp; 10% does not
    exact = TuningTable.from_measurements({"nodes": 2, "lanes": ["gloo", "tcp"]}, rows, margin=0.0)
    assert [e.lane for e in exact.entries] == ["gloo", "gloo"]
