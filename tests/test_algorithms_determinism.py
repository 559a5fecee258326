"""What new users trip on with MSCCL files: the ``reduce_scatter`` spelling, and one-shot all-reduces
whose ranks reduce in different orders (accepted as ``order-dependent``, kept off float sums).

Fixtures in ``tests/data`` (written for these tests, in msccl-tools' layout):

- ``oneshot_allreduce_4r.xml``: in-place one-shot all-reduce on 4 ranks; rank r sends its input to
  every peer and adds the peers' inputs into its own in the order r+1, r+2, r+3, so rank r computes
  ((x_r + x_{r+1}) + x_{r+2}) + x_{r+3}: the same sum, four orders;
- ``reduce_scatter_ring_3r.xml``: out-of-place ring reduce-scatter on 3 ranks, ``coll="reduce_scatter"``.

Every result is compared with NumPy computing the same arithmetic itself.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from commd.algorithms import catalog as cat
from commd.algorithms import checker, dsl, library, mscclxml
from commd.algorithms.errors import ProgramError
from commd.algorithms.postcondition import ChunkRef
from commd.algorithms.simulator import simulate, spread, ulp_distance
from commd.cli.main import main
from commd.core.ops import order_sensitive
from commd.scheduler.config import config_from_wire, parse_config
from commd.scheduler.selection import SelectionError, choose_algorithm

DATA = Path(__file__).resolve().parent / "data"
ONESHOT = DATA / "oneshot_allreduce_4r.xml"
REDUCE_SCATTER = DATA / "reduce_scatter_ring_3r.xml"
NODES = (0, 1, 2, 3)


def own_first_sums(inputs: list[np.ndarray]) -> list[np.ndarray]:
    """What each rank of the one-shot fixture computes, in its own order, by NumPy."""
    n = len(inputs)
    out = []
    for r in range(n):
        acc = inputs[r].copy()
        for k in range(1, n):
            acc = acc + inputs[(r + k) % n]
        out.append(acc)
    return out


# --- the reduce_scatter spelling ------------------------------------------------------------------


def test_reduce_scatter_spelling_reads_checks_and_simulates_as_reducescatter() -> None:
    text = REDUCE_SCATTER.read_text()
    assert 'coll="reduce_scatter"' in text
    old = mscclxml.loads(text, source=str(REDUCE_SCATTER))
    new = mscclxml.loads(text.replace('coll="reduce_scatter"', 'coll="reducescatter"'))
    assert old == new and old.coll == "reducescatter"
    assert checker.report(old).problems == () and checker.check(old).bitwise
    rng = np.random.default_rng(3)
    count = 101  # per rank's output, uneven against the chunking
    for dtype in (np.int64, np.float32):
        inputs = [(rng.integers(-50, 50, 3 * count) if dtype == np.int64 else rng.standard_normal(3 * count))
                  .astype(dtype) for _ in range(3)]
        got_old = simulate(old, inputs, tile_elements=7)
        got_new = simulate(new, inputs, tile_elements=7)
        total = np.sum(inputs, axis=0, dtype=dtype)
        for r in range(3):
            assert got_old[r].tobytes() == got_new[r].tobytes()
            want = total[r * count:(r + 1) * count]
            if dtype == np.int64:
                np.testing.assert_array_equal(got_old[r], want)
            else:
                np.testing.assert_allclose(got_old[r], want, rtol=1e-5, atol=1e-5)
    # written back in the newer runtime's spelling; a file of either spelling has one hash
    assert 'coll="reducescatter"' in mscclxml.dumps(old)
    assert mscclxml.dumps(old) == mscclxml.dumps(new)


def test_reduce_scatter_spelling_through_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["algo", "check", str(REDUCE_SCATTER)]) == 0
    assert main(["algo", "simulate", str(REDUCE_SCATTER), "--count", "64", "--dtype", "int64"]) == 0
    said = capsys.readouterr().out
    assert f"accepted: {REDUCE_SCATTER}" in said and "reducescatter, 3 ranks" in said
    assert "192 output elements equal NumPy exactly" in said


def test_a_dsl_collective_may_say_reduce_scatter() -> None:
    class OldSpelling(dsl.ReduceScatter):
        ir_name = "reduce_scatter"

    with dsl.MSCCLProgram("rs_direct", dsl.fully_connected(3), OldSpelling(3, 1, False), 1) as prog:
        for r in range(3):
            dsl.chunk(r, dsl.Buffer.input, r).copy(r, dsl.Buffer.output, 0)
            for q in range(3):
                if q != r:
                    dsl.chunk(r, dsl.Buffer.output, 0).reduce(dsl.chunk(q, dsl.Buffer.input, r))
    algo = prog.compile()
    assert algo.coll == "reducescatter"
    checker.check(algo)


def test_an_unknown_collective_names_both_spellings() -> None:
    text = REDUCE_SCATTER.read_text().replace('coll="reduce_scatter"', 'coll="reduce-scatter"')
    with pytest.raises(ProgramError, match=r"reducescatter \(or reduce_scatter\)"):
        mscclxml.loads(text)


# --- the determinism class ------------------------------------------------------------------------


def test_check_accepts_the_oneshot_file_as_order_dependent(capsys: pytest.CaptureFixture[str]) -> None:
    algo = mscclxml.load(ONESHOT)
    report = checker.report(algo, source=str(ONESHOT))
    assert report.problems == () and report.analysis is not None
    determinism = report.determinism
    assert determinism is not None and determinism.kind == "order-dependent"
    (diff,) = determinism.differences
    assert diff.sources == {ChunkRef(r, "i", 0) for r in range(4)} and diff.ranks == (0, 1, 2, 3)
    assert len(diff.trees) == 4  # every rank its own order
    assert main(["algo", "check", str(ONESHOT)]) == 0
    said = capsys.readouterr().out
    assert f"accepted: {ONESHOT}" in said
    assert "determinism: order-dependent (ranks reduce the same sources in different orders)" in said
    assert "result r0.i0+r1.i0+r2.i0+r3.i0: ranks 0, 1, 2, 3 hold it in 4 orders" in said
    assert "r1.i0 = (((r1.i0+r2.i0)+r3.i0)+r0.i0)" in said


def test_list_says_which_files_are_order_dependent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shutil.copy(ONESHOT, tmp_path / "mine.xml")
    shutil.copy(REDUCE_SCATTER, tmp_path / "rs.xml")
    assert main(["algo", "list", "--dir", str(tmp_path)]) == 0
    said = capsys.readouterr().out
    assert "  mine.xml: oneshot_own_first_4r (allreduce, 4 ranks) accepted, order-dependent\n" in said
    assert "  rs.xml: reduce_scatter_ring_3r (reducescatter, 3 ranks) accepted\n" in said


@pytest.mark.parametrize("name", library.names())
def test_library_programs_are_bitwise(name: str) -> None:
    for n in (2, 3, 4, 5):
        found = cat.Catalog().get(name, n)
        assert isinstance(found, cat.Program), found
        assert found.determinism == "bitwise"  # (the catalogue's stages are the real checker's)


def test_check_prints_bitwise_for_the_library_ring(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ring.xml"
    mscclxml.dump(library.get("ring", 4), path)
    assert main(["algo", "check", str(path)]) == 0
    assert "determinism: bitwise (every rank reduces each result's sources in the same order" in \
        capsys.readouterr().out


def test_simulate_int64_is_exact_on_every_rank(capsys: pytest.CaptureFixture[str]) -> None:
    algo = mscclxml.load(ONESHOT)
    inputs = [np.random.default_rng(r).integers(-1 << 40, 1 << 40, 1000) for r in range(4)]
    total = np.sum(inputs, axis=0)
    for got in simulate(algo, inputs, tile_elements=64):
        np.testing.assert_array_equal(got, total)
    assert main(["algo", "simulate", str(ONESHOT), "--count", "1000", "--dtype", "int64"]) == 0
    said = capsys.readouterr().out
    assert "4000 output elements equal NumPy exactly" in said
    assert "between ranks: every rank's result is bit-identical to rank 0's" in said
    assert "determinism: order-dependent (ranks reduce the same sources in different orders); int64 sum is exact " \
           "in any order" in said


def test_simulate_float32_shows_how_far_ranks_differ(capsys: pytest.CaptureFixture[str]) -> None:
    algo = mscclxml.load(ONESHOT)
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal(1000).astype(np.float32) for _ in range(4)]
    got = simulate(algo, inputs, tile_elements=100)
    want = own_first_sums(inputs)
    for r in range(4):
        assert got[r].tobytes() == want[r].tobytes(), f"rank {r} is not its own order's float32 sum"
    assert any(got[r].tobytes() != got[0].tobytes() for r in range(1, 4))
    apart = spread(got[1], got[0])
    assert apart.differing == int(np.count_nonzero(got[1] != got[0])) > 0
    assert apart.max_abs == float(np.abs(got[1].astype(np.float64) - got[0]).max())
    assert apart.max_ulp >= 1
    assert main(["algo", "simulate", str(ONESHOT), "--count", "1000", "--dtype", "float32"]) == 0
    said = capsys.readouterr().out
    assert "against NumPy: rank 0 " in said
    assert "between ranks: ranks 1, 2, 3 differ from rank 0 in up to" in said and " ulp (max abs " in said
    assert "determinism: order-dependent" in said
    # max is exact in any order: no difference between ranks
    assert main(["algo", "simulate", str(ONESHOT), "--count", "1000", "--dtype", "float32", "--op", "max"]) == 0
    said = capsys.readouterr().out
    assert "between ranks: every rank's result is bit-identical to rank 0's" in said
    assert "float32 max is exact in any order" in said


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_ulp_distance_counts_representable_values(dtype: type) -> None:
    """Against an independent count: b is a taken k steps of nextafter away (across zero too)."""
    tiny = np.finfo(dtype).smallest_subnormal
    starts, ends, want = [], [], []
    for start, toward, k in ((1.0, np.inf, 0), (1.0, np.inf, 3), (-1.0, -np.inf, 7), (-2 * tiny, np.inf, 5),
                             (tiny, -np.inf, 2), (0.1, -np.inf, 40), (np.finfo(dtype).max, -np.inf, 1)):
        a = b = dtype(start)
        for _ in range(k):
            b = np.nextafter(b, dtype(toward), dtype=dtype)
        starts.append(a)
        ends.append(b)
        want.append(k)
    a, b = np.array(starts, dtype), np.array(ends, dtype)
    assert ulp_distance(a, b).tolist() == want and ulp_distance(b, a).tolist() == want
    assert ulp_distance(np.array([0.0], dtype), np.array([-0.0], dtype)).tolist() == [0]
    nan = np.array([np.nan, np.nan, 1.0], dtype)
    assert ulp_distance(nan, np.array([np.nan, 1.0, np.nan], dtype)).tolist() == [0.0, np.inf, np.inf]


def test_the_order_sensitivity_rule_matches_numpy() -> None:
    """Reduce the same operands in two orders with NumPy: the bits differ only where the rule says
    an op must reduce in one order."""
    rng = np.random.default_rng(11)
    ufuncs = {"sum": np.add, "product": np.multiply, "min": np.minimum, "max": np.maximum,
              "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
    for dtype in ("float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64"):
        for op, ufunc in ufuncs.items():
            if op.startswith("b") and dtype.startswith("float"):
                continue
            parts = [(rng.uniform(0.5, 1.5, 4096) if dtype.startswith("float") else rng.integers(0, 100, 4096))
                     .astype(dtype) for _ in range(4)]
            forward = ufunc(ufunc(ufunc(parts[0], parts[1]), parts[2]), parts[3])
            other = ufunc(ufunc(ufunc(parts[3], parts[1]), parts[0]), parts[2])
            differs = forward.tobytes() != other.tobytes()
            assert differs == order_sensitive(dtype, op), (dtype, op)
    assert order_sensitive("float32", "avg") and order_sensitive("bfloat16", "premul_sum")
    assert not order_sensitive("float32", None) and not order_sensitive("bool", "sum")


# --- selection ------------------------------------------------------------------------------------


def oneshot_catalog(tmp_path: Path) -> cat.Catalog:
    shutil.copy(ONESHOT, tmp_path / "mine.xml")
    catalog = cat.Catalog(tmp_path)
    assert sorted(catalog.files) == ["mine"] and catalog.refused == []
    assert catalog.files["mine"].determinism == "order-dependent"
    return catalog


def test_selection_keeps_an_order_dependent_program_off_float_sums(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    catalog = oneshot_catalog(tmp_path)
    config = parse_config({"algorithms": [{"name": "mine", "kind": "allreduce"}]})

    def pick(dtype: str, op: str) -> cat.Program | None:
        return choose_algorithm("allreduce", dtype, op, 4096, NODES, 4, None, "tcp", config, catalog)

    with caplog.at_level(logging.WARNING, logger="commd.coordinator"):
        assert pick("float32", "sum") is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert "'mine'" in line and "allreduce of 4096 bytes on 4 nodes" in line
    assert "order-dependent" in line and "float32 sum must be bit-identical on every node" in line
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="commd.coordinator"):
        for dtype, op in (("int64", "sum"), ("float32", "max"), ("float32", "min"), ("int32", "product"),
                          ("int64", "bxor")):
            found = pick(dtype, op)
            assert found is not None and found.name == "mine", (dtype, op)
        assert caplog.records == []
        for dtype, op in (("float32", "avg"), ("float64", "product"), ("float16", "premul_sum")):
            assert pick(dtype, op) is None, (dtype, op)
    assert len(caplog.records) == 3 and all("'mine'" in r.getMessage() for r in caplog.records)


def test_a_rule_may_allow_an_order_dependent_program(tmp_path: Path) -> None:
    catalog = oneshot_catalog(tmp_path)
    config = parse_config({"algorithms": [{"name": "mine", "allow_order_dependent": True}]})
    found = choose_algorithm("allreduce", "float32", "sum", 4096, NODES, 4, None, "tcp", config, catalog)
    assert found is not None and found.name == "mine"
    assert config_from_wire(config.to_wire()).algorithm_rules == config.algorithm_rules
    assert config_from_wire(config.to_wire()).algorithm_rules[0].allow_order_dependent
    with pytest.raises(ValueError, match="'allow_order_dependent' must be true or false, got 'yes'"):
        parse_config({"algorithms": [{"name": "mine", "allow_order_dependent": "yes"}]})
    with pytest.raises(ValueError, match="unknown key"):
        parse_config({"rules": [{"lane": "tcp", "allow_order_dependent": True}]})


def test_a_hint_for_an_order_dependent_program_fails_a_float_sum(tmp_path: Path) -> None:
    catalog = oneshot_catalog(tmp_path)
    config = parse_config({})
    with pytest.raises(SelectionError, match="asked for algorithm 'mine', which cannot run it: .*order-dependent"):
        choose_algorithm("allreduce", "float32", "sum", 4096, NODES, 4, "mine", "tcp", config, catalog)
    found = choose_algorithm("allreduce", "int64", "sum", 4096, NODES, 4, "mine", "tcp", config, catalog)
    assert found is not None and found.name == "mine"


def test_the_class_travels_with_node_0s_programs_and_status(tmp_path: Path) -> None:
    catalog = oneshot_catalog(tmp_path)
    assert catalog.status()["files"]["mine"]["determinism"] == "order-dependent"
    member = cat.Catalog()
    member.adopt(catalog.shared())
    assert member.files["mine"].determinism == "order-dependent"
    assert member.files["mine"].digest == catalog.files["mine"].digest
