"""The automatic codec choice as pure logic: ``[[compression]]`` rules, the tuning table's codec
figures, the coordinator's choice released in ``Go.codec`` and the op field's values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_coordinator import LANES, entry, ready, sent

from commd.core.ops import COMPRESS_MIN_BYTES
from commd.protocol.fabric import FabricMessageError, Go
from commd.protocol.schema import ProtocolError
from commd.scheduler.agreement import parse_submission
from commd.scheduler.config import AlgorithmRule, CodecRule, SchedulerConfig, config_from_wire, parse_config
from commd.scheduler.coordinator import Coordinator, Outbox
from commd.scheduler.tuning import SWITCH_MARGIN, TuningTable

MiB = 1 << 20


# ---- the op's field -------------------------------------------------------------------------------

def _submission(codec: str, kind: str = "broadcast", dtype: str = "float32") -> object:
    msg = {"id": 1, "kind": kind, "group": "g", "seq": 0, "dtype": dtype, "count": 4, "codec": codec,
           "buf": {"seg": 0, "off": 0, "n": 4 * (8 if dtype == "int64" else 4)}}
    if kind == "barrier":
        msg.pop("buf")
    return parse_submission(msg, 0, 0, 2, 30.0)


def test_auto_and_none_are_valid_for_every_kind_and_dtype_and_a_codec_still_checked() -> None:
    for codec in ("auto", "none"):
        for kind, dtype in (("broadcast", "int64"), ("allreduce", "float32"), ("barrier", "uint8")):
            assert _submission(codec, kind, dtype).codec == codec
    assert _submission("lossless/per-hop").codec == "lossless/per-hop"
    with pytest.raises(ProtocolError, match=r"unknown codec 'zip'.*or 'auto'.*'none': never compressed"):
        _submission("zip")
    with pytest.raises(ProtocolError, match="codec 'bf16' does not take int64"):
        _submission("bf16", dtype="int64")
    with pytest.raises(ProtocolError, match="barrier does not compress"):
        _submission("lossless", kind="barrier")


# ---- config rules ---------------------------------------------------------------------------------

def test_codec_rules_parse_travel_to_every_node_and_bad_values_are_named() -> None:
    config = parse_config({"compression": [
        {"codec": "lossless", "kind": "broadcast", "min_bytes": 4 * MiB, "max_group": 8},
        {"codec": "bf16"},
        {"codec": "none", "kind": "allgather"}]})
    assert config.codec_rules == [CodecRule("lossless", "broadcast", 4 * MiB, 1 << 62, 1, 8), CodecRule("bf16"),
                                  CodecRule("none", "allgather")]
    assert config_from_wire(config.to_wire()).codec_rules == config.codec_rules
    bad = [({"codec": "zip"}, r"compression\[0\]: 'codec': unknown codec 'zip' .*or 'none'"),
           ({}, r"'codec': unknown codec None"),
           ({"codec": "bf16/per-hop"}, "unknown codec 'bf16/per-hop'"),
           ({"codec": "lossless", "kind": "alltoall"}, "'kind' 'alltoall' is not '\\*' or a kind that compresses"),
           ({"codec": "lossless", "min_bytes": -1}, "'min_bytes' must be a non-negative integer"),
           ({"codec": "lossless", "min_bytes": 9, "max_bytes": 8}, "empty range"),
           ({"codec": "lossless", "level": 3}, r"unknown key\(s\) \['level'\]")]
    for raw, message in bad:
        with pytest.raises(ValueError, match=message):
            parse_config({"compression": [raw]})
    with pytest.raises(ValueError, match=r"'compression' must be an array of tables \(\[\[compression\]\]\)"):
        parse_config({"compression": {"codec": "lossless"}})


# ---- the tuning table ---------------------------------------------------------------------------

def _rows(kind: str, size: int, plain: float, codecs: dict[str, float], gloo: float | None = None) -> list[dict]:
    rows = [{"kind": kind, "nodes": 2, "bytes": size, "lane": "tcp", "median_us": plain}]
    if gloo is not None:
        rows.append({"kind": kind, "nodes": 2, "bytes": size, "lane": "gloo", "median_us": gloo})
    rows += [{"kind": kind, "nodes": 2, "bytes": size, "lane": "tcp", "median_us": t, "codec": name}
             for name, t in codecs.items()]
    return rows


def _codec_table() -> TuningTable:
    rows = (_rows("broadcast", MiB, 1000.0, {"lossless": 990.0, "bf16": 600.0}, gloo=1100.0)  # lossless in margin
            + _rows("broadcast", 16 * MiB, 8000.0, {"lossless": 6000.0, "lossless-zstd": 7000.0, "bf16": 3000.0},
                    gloo=9000.0)
            + _rows("broadcast", 256 * MiB, 100_000.0, {"lossless": 130_000.0, "bf16": 120_000.0})
            + _rows("allgather", 16 * MiB, 5000.0, {"lossless": 4000.0}))
    return TuningTable.from_measurements({"nodes": 2, "lanes": ["gloo", "tcp"]}, rows)


def test_the_table_chooses_a_codec_only_where_it_beats_plain_tcp_by_the_margin(tmp_path: Path) -> None:
    table = _codec_table()
    by = {(e.kind, e.size): e for e in table.entries}
    small, mid, big = (by[("broadcast", n)] for n in (MiB, 16 * MiB, 256 * MiB))
    # 1 MiB: lossless within the margin of plain tcp keeps the plain path; bf16 is faster by far
    assert 990.0 > 1000.0 / (1 + SWITCH_MARGIN) and (small.codec_lossless, small.codec_any) == (None, "bf16")
    assert (mid.codec_lossless, mid.codec_any) == ("lossless", "bf16")  # the fastest lossless / of all
    assert (big.codec_lossless, big.codec_any) == (None, None)  # compressing costs here
    assert mid.lane == "tcp" and mid.codecs["lossless-zstd"]["median_us"] == 7000.0  # figures kept, lanes unchanged
    assert by[("allgather", 16 * MiB)].codec_lossless == "lossless"
    assert table.lookup_codecs("broadcast", 16 * MiB, 2, lossy=False) == ["lossless"]
    assert table.lookup_codecs("broadcast", 16 * MiB, 2, lossy=True) == ["bf16", "lossless"]
    assert table.lookup_codecs("broadcast", MiB, 2, lossy=False) == []
    assert table.lookup_codecs("allreduce", 16 * MiB, 2, lossy=True) == []  # no entry
    # round trip, and the grid shows the choice
    path = tmp_path / "t.json"
    table.save(path)
    loaded = TuningTable.load(path)
    assert loaded.entries == table.entries and loaded.table_id == table.table_id
    assert json.loads(path.read_text())["version"] == 3
    assert "broadcast codec (lossless/any): 1 MiB -/bf16, 16 MiB lossless/bf16, 256 MiB -/-" in table.grid()


def test_old_tables_load_without_codecs_and_bad_codec_fields_are_named(tmp_path: Path) -> None:
    plain = TuningTable.from_measurements({"nodes": 2, "lanes": ["tcp"]}, _rows("broadcast", MiB, 1000.0, {}))
    raw = plain.to_json()
    assert "codecs" not in raw["entries"][0]  # an entry without codec rows keeps its version 2 form
    for version in (1, 2):
        old = TuningTable.from_json({**raw, "version": version})
        assert old.lookup_codecs("broadcast", MiB, 2, lossy=True) == [] and old.entries[0].codecs == {}
    good = _codec_table().to_json()
    entry0 = next(e for e in good["entries"] if e["kind"] == "broadcast" and e["size"] == 16 * MiB)
    bad = [({"codecs": {"zip": {"median_us": 1.0}}}, "'codecs' names 'zip', which is not a codec"),
           ({"codecs": {"bf16": {"median_us": 0}}}, "'codecs' 'bf16' must hold a positive 'median_us'"),
           ({"codec_any": "fp16"}, "'codec_any' must be null or one of the entry's measured codecs"),
           ({"codec_lossless": "bf16"}, "'codec_lossless' names 'bf16', which is lossy")]
    for change, message in bad:
        broken = {**good, "entries": [{**entry0, **change}]}
        with pytest.raises(ValueError, match=message):
            TuningTable.from_json(broken)
    with pytest.raises(ValueError, match="'codec' 'bf16' must be a codec's name .* on the tcp lane"):
        TuningTable.from_measurements({"nodes": 2, "lanes": ["gloo", "tcp"]}, [
            {"kind": "broadcast", "nodes": 2, "bytes": 8, "lane": "gloo", "median_us": 1.0, "codec": "bf16"}])
    with pytest.raises(ValueError, match="compressed rows only, no lane's plain row"):
        TuningTable.from_measurements({"nodes": 2, "lanes": ["tcp"]}, _rows("broadcast", MiB, 1.0, {"bf16": 1.0})[1:])


# ---- the coordinator ------------------------------------------------------------------------------

def _release(config: SchedulerConfig, *, kind: str = "broadcast", nbytes: int = 4 * MiB, dtype: str = "float32",
             seq: int = 0, coord: Coordinator | None = None, **sig: object) -> list[dict]:
    """Both nodes report one op of ``nbytes``; what each node receives (the same for both)."""
    coord = coord or Coordinator(2, config, LANES)
    itemsize = 8 if dtype == "int64" else 4
    count = nbytes // itemsize
    fields: dict[str, object] = {"dtype": dtype, "codec": "", **sig}
    if kind == "allgather":
        fields["counts"] = [count // 4] * 4
    out = Outbox()
    for node, mine in ((0, [0, 1]), (1, [2, 3])):
        item = entry(seq=seq, kind=kind, mine=mine, count=count, sig=fields)
        item["nb"] = nbytes
        coord.report(node, ready([item]), out)
    messages = sent(out)
    assert messages[0] == messages[1] or [m["t"] for m in messages[0]] == ["fail"], messages
    return messages[0]


def _codec(config: SchedulerConfig, **kw: object) -> str | None:
    (go,) = _release(config, **kw)
    assert go["t"] == "go", go
    return go.get("z")


def _rules(*rules: dict) -> SchedulerConfig:
    return parse_config({"compression": list(rules)})


def test_a_rule_chooses_the_codec_released_to_every_node_and_lossy_only_with_auto() -> None:
    config = _rules({"codec": "bf16", "kind": "broadcast", "min_bytes": 8 * MiB}, {"codec": "lossless"})
    assert _codec(config) == "lossless"  # the bf16 rule's range starts above
    assert _codec(config, nbytes=16 * MiB) == "lossless"  # "": never a lossy codec, the next rule applies
    assert _codec(config, nbytes=16 * MiB, codec="auto") == "bf16"
    assert _codec(config, nbytes=16 * MiB, codec="none") is None
    assert _codec(config, kind="allgather", codec="auto") == "lossless"  # the bf16 rule is for broadcasts
    assert _codec(config, kind="allreduce") == "lossless"
    # group sizes: the group has 4 ranks
    assert _codec(_rules({"codec": "lossless", "max_group": 3})) is None
    assert _codec(_rules({"codec": "lossless", "min_group": 4})) == "lossless"
    # a "none" rule stops the choice (the table is not consulted)
    assert _codec(_rules({"codec": "none", "max_bytes": 8 * MiB}, {"codec": "lossless"})) is None


def test_no_codec_below_1_mib_for_other_dtypes_kinds_lanes_or_programs() -> None:
    config = _rules({"codec": "bf16"}, {"codec": "lossless"})
    assert _codec(config, codec="auto", nbytes=COMPRESS_MIN_BYTES) == "bf16"
    assert _codec(config, codec="auto", nbytes=COMPRESS_MIN_BYTES - 4) is None
    # an all-gather counts its whole output
    assert _codec(config, kind="allgather", nbytes=COMPRESS_MIN_BYTES) == "lossless"
    # bf16 does not take int64: the lossless rule after it does; bfloat16 no codec takes
    assert _codec(config, codec="auto", dtype="int64") == "lossless"
    assert _codec(_rules({"codec": "bf16"}), codec="auto", dtype="int64") is None
    assert _codec(config, codec="auto", dtype="bfloat16") is None
    assert _codec(config, kind="reduce", codec="auto", root=0) is None  # not a compressed kind
    assert _codec(config, codec="auto", lane="gloo") is None  # released on another lane: uncompressed
    lane_rule = parse_config({"rules": [{"lane": "gloo"}], "compression": [{"codec": "lossless"}]})
    (go,) = _release(lane_rule)
    assert go["l"] == "gloo" and "z" not in go  # the lane rules chose gloo: no codec


def test_a_program_gets_no_automatic_codec() -> None:
    class Program:
        name, digest, determinism = "ring", "0" * 64, "bitwise"

    class Catalog:
        files: dict = {}

        def runnable(self, name, kind, nnodes, dtype, op):
            return Program()

    coord = Coordinator(2, _rules({"codec": "lossless"}), LANES, catalog=Catalog())
    (go,) = _release(coord.config, coord=coord, kind="allreduce", algo="ring")
    assert go["a"] == "ring" and "z" not in go
    # a lossy codec the op names keeps the lane's own algorithm where a rule (or the table) names a program
    config = SchedulerConfig(algorithm_rules=[AlgorithmRule("ring")])
    coord = Coordinator(2, config, LANES, catalog=Catalog())
    (go,) = _release(config, coord=coord, kind="allreduce", codec="bf16")
    assert go.get("a") is None and go["z"] == "bf16"
    (go,) = _release(config, coord=coord, kind="allreduce", codec="lossless", seq=1)
    assert go["a"] == "ring" and go["z"] == "lossless"
    # a lossless codec the op names codes the program's transfers: released with both
    coord = Coordinator(2, SchedulerConfig(), LANES, catalog=Catalog())
    (go,) = _release(coord.config, coord=coord, kind="allreduce", algo="ring", codec="lossless-zstd")
    assert go["a"] == "ring" and go["z"] == "lossless-zstd"


def test_the_table_decides_after_the_rules_and_a_named_codec_is_released_as_it_is() -> None:
    config = SchedulerConfig(table=_codec_table())
    assert _codec(config, nbytes=16 * MiB) == "lossless"
    assert _codec(config, nbytes=16 * MiB, codec="auto") == "bf16"
    assert _codec(config, nbytes=16 * MiB, codec="auto", dtype="int64") == "lossless"  # bf16 takes no int64
    assert _codec(config, nbytes=MiB, codec="auto") == "bf16" and _codec(config, nbytes=MiB) is None
    assert _codec(config, nbytes=256 * MiB, codec="auto") is None
    config.codec_rules = [CodecRule("lossless-zstd", "broadcast")]
    assert _codec(config, nbytes=16 * MiB, codec="auto") == "lossless-zstd"  # a rule comes first
    # a named codec: released from 1 MiB on, whatever rules and table say
    assert _codec(config, nbytes=16 * MiB, codec="fp16") == "fp16"
    assert _codec(config, codec="bf16/per-hop") == "bf16/per-hop"
    assert _codec(config, nbytes=1000 * 4, codec="bf16") is None


def test_the_choice_is_cached_with_the_pattern_and_a_compressed_op_is_never_fused() -> None:
    config = _rules({"codec": "lossless", "kind": "allreduce"})
    config.fusion_threshold_bytes = 64 << 20
    coord = Coordinator(2, config, LANES)
    first = _release(config, coord=coord, kind="allreduce")
    cid = first[0]["c"]
    assert first[0]["z"] == "lossless" and "fz" not in first[0]
    out = Outbox()
    for seq in (1, 2):
        for node in (0, 1):
            coord.report(node, ready([{"t": "ready", "g": "g", "s": seq, "c": cid}]), out)
    gos = sent(out)[0]
    assert [(g["s"], g.get("z"), g.get("fz")) for g in gos] == [(1, "lossless", None), (2, "lossless", None)]
    assert coord.stats.coord_fast_path == 2


def test_the_release_carries_the_codec_validated_on_decode() -> None:
    go = Go("g", 3, 7, "tcp", codec="bf16/per-hop")
    assert go.to_wire()["z"] == "bf16/per-hop" and Go.from_wire(go.to_wire()) == go
    assert "z" not in Go("g", 3, 7, "tcp").to_wire() and Go.from_wire(Go("g", 3, 7, "tcp").to_wire()).codec is None
    for value, why in (("zip", r"a codec \(bf16, "), (7, "a string"), ("auto", "a codec")):
        with pytest.raises(FabricMessageError, match=rf"field 'z' \(codec\) must be {why}"):
            Go.from_wire({**go.to_wire(), "z": value})


def test_tune_keeps_codec_rows_but_not_per_hop_baselines_and_plain_bench_paths_never_compress() -> None:
    from types import SimpleNamespace

    from commd.bench import tune
    from commd.bench.paths import CommdPath

    def row(path: str, median: float, codec: str | None = None, lane: str = "tcp") -> dict:
        return {"op": "broadcast", "bytes": 16 * MiB, "via": "commd", "lane": lane, "path": path, "algorithm": None,
                "codec": codec, "nodes": 2, "median_us": median, "p95_us": median, "busbw_gbs": 1.0, "check": "ok"}

    rows = [row("commd/tcp", 8000.0), row("commd/auto", 7000.0, lane="auto"), row("commd-tcp+bf16", 3000.0, "bf16"),
            row("commd-tcp+lossless", 6000.0, "lossless"), row("commd-tcp+bf16/per-hop", 1000.0, "bf16/per-hop")]
    meta = {"nnodes": 2, "fabric_lanes": ["tcp"], "ranks_per_node": [1, 1], "node_names": ["a", "b"]}
    (found,) = tune.table_from_rows(meta, rows).entries
    assert set(found.codecs) == {"bf16", "lossless"} and found.measured["tcp"]["median_us"] == 8000.0
    assert (found.codec_lossless, found.codec_any) == ("lossless", "bf16")
    client = SimpleNamespace(rank=0, world_size=2)
    asked = {lane: CommdPath(client, lane, None, 1.0).asked for lane in ("auto", "tcp", "gloo")}
    assert asked == {"auto": None, "tcp": "none", "gloo": "none"}  # auto: the daemons choose
    assert CommdPath(client, "tcp", None, 1.0, compression="bf16/per-hop").asked == "bf16/per-hop"
