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


# ---- uneven all-to-alls: the alltoallv cells ------------------------------------------------------------------
#: elements rank r sends rank j, 2 nodes x 2 ranks (ranks 0, 1 on node 0): EVEN sends every rank 4; SKEWED
#: sends node to node 10, 11, 13 and 14 (bench's skew); RANKS_ONLY differs rank to rank, but every node
#: sends every node 10 elements (the coordinator compares node-to-node blocks, what the lanes move)
EVEN = [[4] * 4 for _ in range(4)]
SKEWED = [[1 + (r + 2 * j) % 5 for j in range(4)] for r in range(4)]
RANKS_ONLY = [[1 + (r + 2 * j) % 4 for j in range(4)] for r in range(4)]


def _alltoall_reports(matrix: list[list[int]], seq: int = 0) -> tuple[dict, dict]:
    """Both nodes' reports of one all-to-all whose rank r sends rank j ``matrix[r][j]`` float32s."""
    def item(node: int) -> dict:
        ranks = (2 * node, 2 * node + 1)
        a2a = [[r, matrix[r], [row[r] for row in matrix]] for r in ranks]
        biggest = max(max(sum(sin), sum(sout)) for _, sin, sout in a2a) * 4
        return entry(seq=seq, kind="alltoall", mine=list(ranks), sig={"reduce_op": None}, a2a=a2a, nb=biggest)

    return item(0), item(1)


def _released_lanes(config: SchedulerConfig, matrices: list[list[list[int]]], catalog: object = None) -> list[str]:
    """The lane the coordinator releases each all-to-all on (the same on both nodes, asserted)."""
    coord = Coordinator(2, config, LANES, catalog=catalog)
    out = Outbox()
    for seq, matrix in enumerate(matrices):
        first, second = _alltoall_reports(matrix, seq)
        coord.report(0, ready([first]), out)
        coord.report(1, ready([second]), out)
    lanes = [[m["l"] for m in _go_items(out, node)] for node in (0, 1)]
    assert lanes[0] == lanes[1] and len(lanes[0]) == len(matrices), sent(out)
    return lanes[0]


def _alltoall_table(*, with_v: bool = True) -> TuningTable:
    """alltoall cells won by tcp; alltoallv cells (if ``with_v``) won by gloo, at 1 KiB and 64 KiB."""
    rows = _rows({1024: {"tcp": 50.0, "gloo": 80.0}, 65536: {"tcp": 300.0, "gloo": 400.0}}, kind="alltoall")
    if with_v:
        rows += _rows({1024: {"tcp": 90.0, "gloo": 60.0}, 65536: {"tcp": 500.0, "gloo": 350.0}}, kind="alltoallv")
    return TuningTable.from_measurements({"nodes": 2, "lanes": ["gloo", "tcp"]}, rows)


@pytest.mark.timeout(10)
def test_an_uneven_alltoall_is_decided_by_the_alltoallv_cells() -> None:
    table = _alltoall_table()
    assert table.lookup("alltoall", 1024, 2) == "tcp" and table.lookup("alltoallv", 1024, 2) == "gloo"
    assert table.lookup("alltoallv", 1 << 20, 2) == "gloo"  # the last cell reaches to any size
    config = SchedulerConfig()
    config.adopt_table(table, 2, ["gloo", "tcp"])
    args = ("alltoall", "float32", None, 1024, (0, 1), 4, None, config, LANES)
    assert choose_lane(*args) == "tcp" and choose_lane(*args, variant="alltoallv") == "gloo"
    # the coordinator: even blocks -> the alltoall cell, node-to-node blocks that differ -> the alltoallv one
    assert _released_lanes(config, [EVEN, SKEWED, RANKS_ONLY]) == ["tcp", "gloo", "tcp"]
    grid = table.grid()
    assert "alltoallv" in grid.splitlines()[3] and grid.splitlines()[4].split() == ["1", "KiB", "tcp", "gloo"]


@pytest.mark.timeout(10)
def test_without_alltoallv_cells_an_uneven_alltoall_falls_back_to_the_alltoall_cells(
        caplog: pytest.LogCaptureFixture) -> None:
    from commd.algorithms.catalog import Catalog

    # an older table: alltoall cells only, where tcp wins by a program ("alltoall") that no uneven
    # all-to-all can run; its own (native) algorithm loses to gloo
    rows = _rows({4096: {"tcp": 300.0, "gloo": 200.0}}, kind="alltoall")
    rows.append({**rows[0], "algorithm": "alltoall", "median_us": 100.0})
    older = TuningTable.from_measurements({"nodes": 2, "lanes": ["gloo", "tcp"]}, rows)
    assert (older.entries[0].lane, older.entries[0].algorithm) == ("tcp", "alltoall")
    assert older.lookup("alltoall", 4096, 2) == "tcp" and older.lookup_algorithm("alltoall", 4096, 2) == "alltoall"
    assert older.lookup("alltoallv", 4096, 2) == "gloo"  # the lanes' own figures: no program runs it
    assert older.lookup_algorithm("alltoallv", 4096, 2) is None
    config = SchedulerConfig(table=older)
    assert _released_lanes(config, [EVEN, SKEWED]) == ["tcp", "gloo"]
    # the fallback is per group-size class: alltoallv cells for 2 nodes do not decide 3-node ops
    mixed = _rows({4096: {"tcp": 50.0, "gloo": 80.0}}, kind="alltoall", nodes=3)
    mixed += _rows({4096: {"tcp": 90.0, "gloo": 60.0}}, kind="alltoallv", nodes=2)
    table = TuningTable.from_measurements({"nodes": 3, "lanes": ["gloo", "tcp"]}, mixed)
    assert table.lookup("alltoallv", 4096, 2) == "gloo" and table.lookup("alltoallv", 4096, 3) == "tcp"
    # an uneven all-to-all on the tcp lane is not offered the alltoall cells' program (no warning per op)
    config = SchedulerConfig(table=older, rules=[LaneRule("tcp", kind="alltoall")])
    with caplog.at_level("WARNING", logger="commd.coordinator"):
        assert _released_lanes(config, [SKEWED], catalog=Catalog(None)) == ["tcp"]
    assert "tuning table" not in caplog.text, caplog.text


@pytest.mark.timeout(10)
def test_tables_without_alltoallv_entries_still_load(tmp_path: Path) -> None:
    entry_v2 = {"kind": "alltoall", "nodes": "2", "min_bytes": 0, "max_bytes": 1 << 62, "size": 4096,
                "lane": "gloo", "algorithm": "native", "measured": {"tcp": {"median_us": 90.0},
                                                                    "gloo": {"median_us": 60.0}}}
    broadcast_v3 = {"kind": "broadcast", "nodes": "2", "min_bytes": 0, "max_bytes": 1 << 62, "size": 4096,
                    "lane": "tcp", "algorithm": None, "measured": {"tcp": {"median_us": 50.0}},
                    "codecs": {"lossless": {"median_us": 40.0}}, "codec_lossless": "lossless",
                    "codec_any": "lossless"}
    entry_v1 = {k: v for k, v in entry_v2.items() if k != "algorithm"}
    for version, entries in ((1, [entry_v1]), (2, [entry_v2]), (3, [entry_v2, broadcast_v3])):
        path = tmp_path / f"v{version}.json"
        path.write_text(json.dumps({"format": "commd-tuning", "version": version, "id": f"old{version}",
                                    "created": "then", "fabric": {"nodes": 2, "lanes": ["gloo", "tcp"]},
                                    "entries": entries}))
        old = TuningTable.load(path)
        assert old.lookup("alltoallv", 4096, 2) == old.lookup("alltoall", 4096, 2) == "gloo", version
        assert "alltoallv" not in old.grid()
    # a table with alltoallv cells has the same shape: the version its other entries need, and it loads back
    table = _alltoall_table()
    table.save(tmp_path / "new.json")
    assert json.loads((tmp_path / "new.json").read_text())["version"] == 2
    assert TuningTable.load(tmp_path / "new.json").entries == table.entries


@pytest.mark.timeout(10)
def test_lane_rules_for_alltoall_serve_uneven_ones_and_alltoallv_rules_only_those() -> None:
    from commd.scheduler.config import config_from_wire, parse_config

    config = parse_config({"rules": [{"kind": "alltoallv", "lane": "gloo", "max_bytes": 2048},
                                     {"kind": "alltoall", "lane": "tcp"}]})
    assert [(r.kind, r.lane) for r in config.rules] == [("alltoallv", "gloo"), ("alltoall", "tcp")]
    # a table would say otherwise (alltoall: tcp, alltoallv: gloo): the rules win
    config.adopt_table(_alltoall_table(), 2, ["gloo", "tcp"])
    config.rules.reverse()  # the alltoall rule first: it serves every all-to-all, even or not
    assert _released_lanes(config, [EVEN, SKEWED]) == ["tcp", "tcp"]
    only_v = SchedulerConfig(rules=[LaneRule("tcp", kind="alltoallv")])  # (no table: default tcp)
    only_v.default_lane = "gloo"
    assert _released_lanes(only_v, [EVEN, SKEWED]) == ["gloo", "tcp"]
    assert [r.kind for r in config_from_wire(only_v.to_wire()).rules] == ["alltoallv"]
    for table in ("algorithms", "compression"):  # programs and codecs never run uneven all-to-alls
        with pytest.raises(ValueError, match=rf"{table}\[0\]: 'kind' 'alltoallv' is not"):
            parse_config({table: [{"kind": "alltoallv", "name" if table == "algorithms" else "codec": "x"}]})
