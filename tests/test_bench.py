"""`commd bench` and `commd tune`: rows, formulas, the correctness check, option errors, the plot, a tuning table.

Runs of the benchmark are subprocesses (they start daemons and workers), each
bounded by a timeout; the sweep sizes are tiny so the whole file stays short.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from commd.algorithms import library
from commd.bench.cases import alltoallv_splits, make_case, pattern
from commd.bench.spec import busbw_factor, spec_from_args
from commd.bench.worker import SetupError, build_parser, resolve_lanes
from commd.cli.main import main as commd_main
from commd.sim.hosts import netns_unavailable

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def rt(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path_factory.mktemp("rt")
    monkeypatch.setenv("COMMD_RUNTIME_DIR", str(path))
    monkeypatch.setenv("COMMD_TUNING_DIR", str(path / "tuning"))  # never touch the user's tables
    for key in ("COMMD_JOB", "COMMD_SECRET"):
        monkeypatch.delenv(key, raising=False)
    return path


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "commd", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


# ---- pure parts ------------------------------------------------------------------------
def _numpy_alloc(dtype: str):  # noqa: ANN202 - a small factory
    def alloc(count: int) -> tuple[np.ndarray, np.ndarray]:
        a = np.empty(count, dtype=dtype)
        return a, a

    return alloc


def test_reference_check_accepts_the_true_result_and_names_a_wrong_one() -> None:
    world = 3
    for rank in range(world):
        case = make_case("reduce_scatter", 4096, rank, world, 4, _numpy_alloc("float32"))
        assert case is not None
        c = case.count
        assert case.nbytes == c * world * 4 == (4096 // 4 // 3) * 3 * 4  # S: the total buffer, whole elements
        case.fill()
        # What a correct reduce_scatter delivers, computed independently of Case.expected.
        inputs = [pattern(j, 0, c * world) for j in range(world)]
        case.view["out"][:] = np.sum(inputs, axis=0)[rank * c:(rank + 1) * c]
        assert case.check("commd/tcp") is None
        case.view["out"][7] += 1
        msg = case.check("commd/tcp")
        assert msg is not None
        assert "reduce_scatter" in msg and "S=4092 B" in msg and "commd/tcp" in msg and f"rank {rank}" in msg
        assert "index 7" in msg


def test_busbw_factors_are_the_nccl_tests_ones() -> None:
    assert busbw_factor("allreduce", 4) == pytest.approx(1.5)
    for op in ("allgather", "reduce_scatter", "alltoall", "alltoallv"):
        assert busbw_factor(op, 4) == pytest.approx(0.75)
    for op in ("broadcast", "reduce", "sendrecv"):
        assert busbw_factor(op, 4) == 1.0


@pytest.mark.timeout(10)
def test_alltoallv_cases_have_the_documented_skew_and_are_checked_exactly() -> None:
    world, nbytes = 4, 4096
    splits = alltoallv_splits(world, nbytes // 4)
    assert splits is not None
    base = nbytes // 4 // 14  # the largest buffer of 4 ranks is 14 units (rank 2's input, rank 3's output)
    for r in range(world):
        for j in range(world):
            extra = nbytes // 4 - 14 * base if (r, j) == (2, 2) else 0  # rank 2 keeps the remainder itself
            assert splits[r][j] == base * (1 + (r + 2 * j) % 5) + extra
    sent = [sum(row) for row in splits]
    received = [sum(row[j] for row in splits) for j in range(world)]
    assert max(sent + received) == nbytes // 4 and len(set(sent)) == world  # S: the largest buffer, exactly
    node_to_node = {(a, b): sum(splits[r][j] for r in (2 * a, 2 * a + 1) for j in (2 * b, 2 * b + 1))
                    for a in (0, 1) for b in (0, 1)}
    assert len(set(node_to_node.values())) == 4  # 2 nodes x 2 ranks: the nodes send each other unequal blocks
    cases = [make_case("alltoallv", nbytes, r, world, 4, _numpy_alloc("float32")) for r in range(world)]
    for case in cases:
        assert case is not None and case.nbytes == nbytes and case.splits == splits
        case.fill()
    for r, case in enumerate(cases):  # the exchange, written out independently of Case.expected
        blocks = []
        for j, peer in enumerate(cases):
            start = sum(splits[j][:r])
            blocks.append(peer.view["in"][start:start + splits[j][r]])
        case.view["out"][:] = np.concatenate(blocks)
        assert case.check("commd/local") is None
    cases[3].view["out"][-1] += 1
    msg = cases[3].check("mpi")
    assert msg is not None and "alltoallv S=4096 B path mpi on rank 3" in msg
    # too small for one element per unit: skipped (4 ranks need 14 elements)
    assert make_case("alltoallv", 32, 0, world, 4, _numpy_alloc("float32")) is None
    assert make_case("alltoallv", 64, 0, world, 4, _numpy_alloc("float32")) is not None
    assert spec_from_args(build_parser().parse_args(["--ops", "all_to_all_v,alltoall"])).ops == ["alltoallv",
                                                                                                 "alltoall"]


@pytest.mark.parametrize("args, words", [
    (["--min-bytes", "4M", "--max-bytes", "1K"], "larger than --max-bytes"),
    (["--ops", "allreduce,frobnicate"], "unknown op 'frobnicate'"),
    (["--lanes", "carrier-pigeon"], "unknown lane 'carrier-pigeon'"),
    (["--min-bytes", "3000"], "not a power of two"),
    (["--max-bytes", "lots"], "not a byte count"),
    (["--step-factor", "3"], "--step-factor 3"),
    (["--compare", "nccl"], "unknown peer 'nccl'"),
    (["--rate", "1gbit"], "need --hosts"),
    (["--nproc-per-node", "1"], "at least 2 ranks"),
    (["--plot", "out.jpg"], "give a .png file name"),
    (["--ops", "broadcast", "--compression", "zip"], "--compression: unknown codec 'zip'"),
    (["--ops", "broadcast", "--compression", "bf16/twice"], "the only variant of a codec is 'per-hop'"),
    (["--ops", "alltoall", "--compression", "bf16"], "--compression: broadcast, allgather, allreduce compress; --ops has none of them"),
    (["--ops", "alltoallv", "--algorithms", "all"], "programs run allreduce,allgather,alltoall,alltonext only"),
    (["--ops", "broadcast", "--compression", "bf16", "--dtype", "int64"], "model-like float32 data"),
])
def test_bench_rejects_bad_options(args: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert commd_main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert words in err, err


def test_bench_hosts_without_root_says_so(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert commd_main(["bench", "--hosts", "2"]) == 2
    assert "needs root" in capsys.readouterr().err


def test_tune_needs_several_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    assert commd_main(["tune", "--nproc-per-node", "2"]) == 2
    assert "use --hosts H" in capsys.readouterr().err


# ---- runs ------------------------------------------------------------------------------
@pytest.mark.extended
def test_single_node_bench_rows_json_and_plot(rt: Path, tmp_path: Path) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    n = 3
    proc = _run(["bench", "--nproc-per-node", str(n), "--ops", "allreduce,allgather,sendrecv",
                 "--min-bytes", "1K", "--max-bytes", "4K", "--step-factor", "4", "--iters", "3", "--warmup", "1",
                 "--compare", "gloo", "--json", str(out), "--plot", str(png)])
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    want_paths = {"commd/local", "gloo"}
    for op in ("allreduce", "allgather", "sendrecv"):
        mine = [r for r in rows if r["op"] == op]
        assert {r["path"] for r in mine} == want_paths
        for requested in (1024, 4096):
            size = (requested // 4 // n) * n * 4 if op == "allgather" else requested
            at = [r for r in mine if r["bytes"] == size]
            assert len(at) == 2, (op, size, [r["bytes"] for r in mine])
    for r in rows:
        assert r["check"] == "ok" and r["iters"] == 3 and r["world"] == n
        assert r["factor"] == pytest.approx(busbw_factor(r["op"], n))
        assert r["algbw_gbs"] == pytest.approx(r["bytes"] / (r["median_us"] * 1e-6) / 1e9)
        assert r["busbw_gbs"] == pytest.approx(r["algbw_gbs"] * r["factor"])
        assert r["p95_us"] >= r["median_us"] > 0
        if r["via"] == "commd":
            assert r["ratios"]["gloo"] > 0
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert "allgather" in proc.stdout and "commd/local" in proc.stdout and "x gloo" in proc.stdout


@pytest.mark.extended
def test_worker_under_a_user_launch_prints_the_table_and_the_check_catches_a_wrong_result(rt: Path) -> None:
    worker = ["launch", "--nproc-per-node", "2", "-m", "commd.bench.worker", "--ops", "broadcast,allreduce",
              "--min-bytes", "1K", "--max-bytes", "1K", "--iters", "2", "--warmup", "0"]
    ok = _run(worker)
    assert ok.returncode == 0, ok.stderr
    assert "broadcast" in ok.stdout and "commd/local" in ok.stdout
    bad = _run([*worker, "--corrupt", "allreduce"])
    assert bad.returncode != 0
    assert "wrong result: allreduce S=1024 B path commd/local on rank 1" in bad.stderr, bad.stderr


@pytest.mark.timeout(90)
@pytest.mark.extended
def test_alltoallv_runs_on_every_path_and_is_checked(rt: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = _run(["bench", "--nproc-per-node", "2", "--ops", "alltoallv", "--compare", "gloo,mpi", "--min-bytes", "1K",
                 "--max-bytes", "64K", "--iters", "3", "--warmup", "1", "--json", str(out)], timeout=80)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    sizes = [1 << 10, 1 << 12, 1 << 14, 1 << 16]
    assert sorted((r["path"], r["bytes"]) for r in rows) == sorted(
        (path, size) for path in ("commd/local", "gloo", "mpi") for size in sizes)
    for r in rows:  # S: the requested size, exactly (the largest buffer: rank 0's input, rank 1's output)
        assert r["op"] == "alltoallv" and r["check"] == "ok" and r["factor"] == pytest.approx(0.5)
        assert r["busbw_gbs"] == pytest.approx(r["bytes"] / (r["median_us"] * 1e-6) / 1e9 * 0.5)
    assert "S = largest rank's buffer" in proc.stdout and "x mpi" in proc.stdout
    # the check is made on this op's results too: a wrong one stops the run, naming it
    bad = _run(["launch", "--nproc-per-node", "2", "-m", "commd.bench.worker", "--ops", "alltoallv", "--min-bytes",
                "1K", "--max-bytes", "1K", "--iters", "1", "--warmup", "0", "--corrupt", "alltoallv"], timeout=60)
    assert bad.returncode != 0
    assert "wrong result: alltoallv S=1024 B path commd/local on rank 1" in bad.stderr, bad.stderr


def test_lane_choice_per_fabric() -> None:
    spec = spec_from_args(build_parser().parse_args(["--lanes", "auto,all"]))
    assert resolve_lanes(spec, False, []) == ["local"]  # one node: no lanes, one "local" row per size
    assert resolve_lanes(spec, True, ["gloo", "tcp"]) == ["auto", "gloo", "tcp"]
    with pytest.raises(SetupError, match="a single node has no inter-node lanes"):
        resolve_lanes(spec_from_args(build_parser().parse_args(["--lanes", "tcp"])), False, [])
    with pytest.raises(SetupError, match="this fabric has no lane 'mpi'.*mpiexec"):
        resolve_lanes(spec_from_args(build_parser().parse_args(["--lanes", "mpi"])), True, ["gloo", "tcp"])


@pytest.mark.slow  # 10 s: make test-all (tables steering the lane choice: test_fusion_tuning.py)
def test_tune_on_simulated_hosts_writes_a_loadable_table(rt: Path, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("simulated hosts need root (network namespaces)")
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    from commd.scheduler.tuning import SWITCH_MARGIN, TuningTable, default_table_path

    proc = _run(["tune", "--hosts", "2", "--nproc-per-node", "1", "--ops", "allreduce,sendrecv",
                 "--min-bytes", "1K", "--max-bytes", "4K", "--iters", "3", "--time-per-size", "0.05"], timeout=180)
    assert proc.returncode == 0, proc.stderr
    path = default_table_path("host0", 2)
    assert path.is_relative_to(rt / "tuning")
    table = TuningTable.load(path)
    assert table.fabric["nodes"] == 2
    assert set(table.fabric["lanes"]) >= {"tcp", "gloo"}
    assert {(e.kind, e.size) for e in table.entries} == {(k, s) for k in ("allreduce", "sendrecv")
                                                       for s in (1024, 4096)}
    programs = {f"tcp/{name}" for name in library.names() if library.describe(name).coll == "allreduce"}
    for entry in table.entries:
        lanes = {k: m for k, m in entry.measured.items() if "/" not in k}
        assert set(lanes) == set(table.fabric["lanes"])  # every lane measured; the winner is the
        fastest = min(m["median_us"] for m in lanes.values())  # fastest, or within the tie margin
        if entry.kind == "sendrecv":  # no program runs a send: lanes only
            assert set(entry.measured) == set(lanes) and entry.algorithm is None
            assert entry.measured[entry.lane]["median_us"] <= fastest * (1 + SWITCH_MARGIN)
            continue
        # all-reduce: every library all-reduce program measured on tcp (the plain tcp row is native);
        # the entry names the tcp lane's best, and tcp competes at that one's time
        assert set(entry.measured) - set(lanes) == programs
        tcp_candidates = {"native": entry.measured["tcp"]} | {k[4:]: m for k, m in entry.measured.items() if "/" in k}
        best_tcp = min(m["median_us"] for m in tcp_candidates.values())
        assert entry.algorithm in tcp_candidates
        assert tcp_candidates[entry.algorithm]["median_us"] <= best_tcp * (1 + SWITCH_MARGIN)
        chosen = tcp_candidates[entry.algorithm] if entry.lane == "tcp" else entry.measured[entry.lane]
        assert chosen["median_us"] <= min(fastest, best_tcp) * (1 + SWITCH_MARGIN)
    shown = _run(["tune", "--show"])
    assert shown.returncode == 0 and "allreduce" in shown.stdout and str(path) in shown.stdout


def test_compressed_broadcast_cases_use_model_like_data_and_expect_the_codecs_rounding() -> None:
    """A codec path's broadcast carries data a model would (the small-integer pattern would shrink to
    nothing) and its check expects what the codec delivers: torch's bfloat16 rounding for bf16."""
    import numpy as np
    import torch

    from commd.bench.cases import make_case

    def case(rank: int):  # noqa: ANN202
        made = make_case("broadcast", 1 << 20, rank, 2, 4, lambda n: (None, np.zeros(n, np.float32)), codec="bf16")
        assert made is not None
        made.fill()
        return made

    root, other = case(0), case(1)
    data = root.view["buf"].copy()
    want = torch.from_numpy(data).to(torch.bfloat16).to(torch.float32).numpy()
    assert len(np.unique(data)) > 10_000  # not the 13-periodic pattern
    assert np.array_equal(root.expected()["buf"], want) and np.array_equal(other.expected()["buf"], want)
    assert (other.view["buf"] == -1).all()
    assert root.check("x") is not None  # the root's exact values are not what a bf16 broadcast leaves
    root.view["buf"][:] = want
    assert root.check("x") is None


def test_compression_benchmark_judges_its_targets_from_the_rows() -> None:
    """benchmarks/compression.py's verdicts from hand-stated medians (µs), each target both ways."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "compression.py"
    spec = importlib.util.spec_from_file_location("compression_benchmark", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    m = 1 << 20

    def rows(medians: dict[str, dict[int, float]]) -> dict[str, list[dict[str, object]]]:
        return {"rows": [{"op": "broadcast", "bytes": s, "path": p, "check": "ok", "median_us": t}
                         for p, by in medians.items() for s, t in by.items()]}

    data = {"1gbit": rows({"commd-tcp+bf16": {64 * m: 300.0}, "mpi": {64 * m: 1000.0}}),  # 70% below: met
            "10gbit": rows({"commd-tcp+bf16": {64 * m: 100.0}, "commd-tcp+bf16/per-hop": {64 * m: 120.0}}),
            "unshaped": rows({"commd/auto": {m: 100.0, 4 * m: 200.0}, "commd/tcp": {m: 98.0, 4 * m: 150.0},
                              "mpi": {m: 120.0, 4 * m: 400.0}})}
    verdicts = {name[:2]: (met, evidence) for name, met, evidence in bench.targets(data)}
    assert verdicts["C1"] == (True, "0 ms vs MPI 1 ms: 70% below")
    assert verdicts["C2"] == (False, "1.20x")
    assert verdicts["C3"] == (False, "worst 0.75x at 4M (commd's plain paths); against Gloo/MPI directly: "
                                     "worst 1.20x at 1M")  # the plain chain beat the daemons' own choice
    assert all(met is None for met, _ in {n[:2]: (m_, e) for n, m_, e in bench.targets({})}.values())


# ---- groups of some of the job's nodes (--group-nodes) ---------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize("args, words", [
    (["--group-nodes", "1"], "--group-nodes 1: a group measures the lanes between nodes, so it spans at least 2"),
    (["--group-nodes", "2,two"], "--group-nodes: 'two' is not a node count"),
    (["--group-nodes", "2"], "--group-nodes 2: a group cannot span more nodes than the job; this host is one node"),
])
def test_bench_rejects_bad_group_nodes(args: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert commd_main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert words in err, err


@pytest.mark.timeout(30)
def test_group_nodes_fit_the_job_and_tune_sweeps_the_powers_of_two_below_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    from commd.bench.spec import SpecError, check_group_nodes, measure_argv, sweep_group_nodes

    parse = build_parser().parse_args
    assert spec_from_args(parse([])).group_nodes is None  # the whole job only, as without the option
    spec = spec_from_args(parse(["--group-nodes", "4,2,4"]))
    assert spec.group_nodes == [2, 4]
    assert spec_from_args(parse(measure_argv(spec))).group_nodes == [2, 4]  # the worker gets the same groups
    assert "--group-nodes" not in measure_argv(spec_from_args(parse([])))
    check_group_nodes([2, 4], 4)
    check_group_nodes([2, 3], 3)  # the job's own count need not be a power of two
    with pytest.raises(SpecError, match=r"--group-nodes 3: give a power of two or the job's node count \(4\)"):
        check_group_nodes([2, 3], 4)
    with pytest.raises(SpecError, match="--group-nodes 8: a group cannot span more nodes than the job; the job "
                                        "has 4 nodes"):
        check_group_nodes([8], 4)
    assert [sweep_group_nodes(n) for n in (2, 3, 4, 6, 8)] == [[2], [2, 3], [2, 4], [2, 4, 6], [2, 4, 8]]
    # commd tune refuses a group that does not fit its hosts before it makes any
    assert commd_main(["tune", "--hosts", "4", "--group-nodes", "3"]) == 2
    assert "--group-nodes 3: give a power of two or the job's node count (4)" in capsys.readouterr().err


class _GroupRank:
    """One rank of a group, alone in this process: its op leaves what NumPy says the group's op would."""

    via, lane, label, algorithm = "commd", "tcp", "commd/tcp", None

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def alloc(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        a = np.empty(count, dtype=np.float32)
        return a, a

    def run(self, case) -> None:  # noqa: ANN001
        for name, want in case.expected().items():
            case.view[name][:] = want

    def barrier(self) -> None:
        pass


class _Alone:
    """A sync of one rank: every agreement is its own values."""

    def max_each(self, values: list[float]) -> list[float]:
        return list(values)

    def gather_errors(self, error: str | None) -> list[str]:
        return [error] if error else []

    def barrier(self) -> None:
        pass


def _group_rows(nodes: list[str], count: int, ops: list[str], nbytes: int = 4096) -> list[dict]:
    """Rank 0's rows of ``ops`` measured on the group of the first ``count`` of ``nodes``'s nodes."""
    from argparse import Namespace

    from commd.bench import report
    from commd.bench.worker import BenchGroup, RowSink, group_label, group_ranks, measure_block

    ranks = group_ranks(nodes, count)
    nnodes = len(set(nodes))
    group = BenchGroup(count, ranks, len(ranks) == len(nodes), True, "g", group_label(count, nnodes),
                       [nodes[r] for r in ranks], sync=_Alone())
    spec = spec_from_args(build_parser().parse_args(["--iters", "3", "--warmup", "0"]))
    sink = RowSink(None)
    for op in ops:
        measure_block(Namespace(corrupt=None), spec, group, op, nbytes, [_GroupRank(0, len(ranks))], 4, sink, 0,
                      report.progress(0, enabled=False), {}, set())
    return sink.rows


@pytest.mark.timeout(30)
def test_rows_of_a_subgroup_carry_its_nodes_ranks_and_label() -> None:
    from commd.bench import report, tune
    from commd.bench.worker import group_ranks

    nodes = ["a", "a", "b", "b", "c", "c", "d", "d"]  # 4 nodes x 2 ranks
    assert group_ranks(nodes, 2) == [0, 1, 2, 3] and group_ranks(nodes, 4) == list(range(8))
    assert group_ranks(["b", "a", "b", "a", "c"], 2) == [0, 1, 2, 3]  # the first nodes by their first rank
    sub = _group_rows(nodes, 2, ["allreduce", "sendrecv"])
    world = _group_rows(nodes, 4, ["allreduce", "sendrecv"])
    got = {(r["group"], r["op"]): (r["nodes"], r["group_nodes"], r["world"], r["factor"], r["check"])
           for r in sub + world}
    assert got == {("nodes 0-1", "allreduce"): (2, 2, 4, 1.5, "ok"), ("nodes 0-1", "sendrecv"): (2, 2, 4, 1.0, "ok"),
                   ("world", "allreduce"): (4, 4, 8, 1.75, "ok"), ("world", "sendrecv"): (2, 4, 8, 1.0, "ok")}
    # the printed table: a block per op and group, each row naming its group
    meta = {"world": 8, "nnodes": 4, "node_names": ["a", "b", "c", "d"], "ranks_per_node": [2] * 4,
            "spec": {"dtype": "float32"}}
    text = report.format_table(meta, sub + world)
    assert "allreduce  (group nodes 0-1: 4 ranks on 2 nodes, busbw = algbw x 1.5;" in text
    assert "allreduce  (group world: 8 ranks on 4 nodes, busbw = algbw x 1.75;" in text
    assert next(line for line in text.splitlines() if "commd/tcp" in line).split()[:3] == ["4K", "nodes", "0-1"]
    # the sweep's table: a cell per group-size class; a send joins 2 nodes in either group (the largest kept)
    lanes = [dict(r, lane=lane, path=f"commd/{lane}", median_us=r["median_us"] * (2.0 if slow else 1.0))
             for r in sub + world for lane, slow in (("tcp", r["group"] == "world"), ("gloo", r["group"] != "world"))]
    table = tune.table_from_rows(meta | {"fabric_lanes": ["gloo", "tcp"]}, lanes)
    assert sorted((e.kind, e.nodes, e.lane) for e in table.entries) == [
        ("allreduce", "2", "tcp"), ("allreduce", "3-4", "gloo"), ("sendrecv", "2", "gloo")]
    (send,) = [e for e in table.entries if e.kind == "sendrecv"]
    (kept,) = [r for r in world if r["op"] == "sendrecv"]
    assert send.measured["tcp"]["median_us"] == kept["median_us"] * 2.0


@pytest.mark.timeout(30)
def test_a_table_with_2_and_3_4_node_cells_answers_a_2_node_op_from_its_2_node_cells() -> None:
    """The coordinator of a 4-node fabric looks an op up by the nodes its group spans: an all-reduce of
    a group on 2 nodes takes the 2-node cell's lane, one of the whole job the 3-4-node cell's."""
    from test_coordinator import LANES, entry, ready, sent

    from commd.bench import tune
    from commd.scheduler.config import SchedulerConfig
    from commd.scheduler.coordinator import Coordinator, Outbox

    def row(nodes: int, lane: str, median: float) -> dict:
        return {"op": "allreduce", "bytes": 4096, "via": "commd", "lane": lane, "path": f"commd/{lane}",
                "algorithm": None, "nodes": nodes, "group_nodes": nodes, "median_us": median, "p95_us": median,
                "busbw_gbs": 1.0, "check": "ok"}

    meta = {"nnodes": 4, "fabric_lanes": ["gloo", "tcp"], "ranks_per_node": [2] * 4, "node_names": list("abcd")}
    table = tune.table_from_rows(meta, [row(2, "tcp", 90.0), row(2, "gloo", 40.0), row(4, "tcp", 50.0),
                                        row(4, "gloo", 95.0)])
    assert sorted((e.nodes, e.lane) for e in table.entries) == [("2", "gloo"), ("3-4", "tcp")]
    assert table.lookup("allreduce", 4096, 2) == "gloo" and table.lookup("allreduce", 4096, 4) == "tcp"
    config = SchedulerConfig()
    config.adopt_table(table, 4, ["gloo", "tcp"])
    assert config.table is table
    coord = Coordinator(4, config, LANES)
    out = Outbox()
    # group "pair": ranks 0-3 on nodes 0 and 1; group "all": ranks 0-7 on nodes 0-3
    pair = {"group": "pair", "count": 1024, "ranks": (0, 1, 2, 3), "pl": (0, 0, 1, 1)}
    whole = {"group": "all", "count": 1024, "ranks": tuple(range(8)), "pl": (0, 0, 1, 1, 2, 2, 3, 3)}
    for node in range(4):
        items = [entry(**pair, mine=[2 * node, 2 * node + 1])] if node < 2 else []
        coord.report(node, ready([*items, entry(**whole, mine=[2 * node, 2 * node + 1])]), out)
    lanes = {(node, m["g"]): m["l"] for node, messages in sent(out).items() for m in messages if m["t"] == "go"}
    assert lanes == {(0, "pair"): "gloo", (1, "pair"): "gloo",
                     (0, "all"): "tcp", (1, "all"): "tcp", (2, "all"): "tcp", (3, "all"): "tcp"}, sent(out)


@pytest.mark.timeout(60)
def test_mpi_phase_measures_a_subgroup_and_the_ranks_outside_wait(tmp_path: Path) -> None:
    """The MPI-direct phase on 3 nodes (named by COMMD_NODE, as on simulated hosts) with --group-nodes 2,3:
    the first 2 nodes' ranks measure on their own communicator, checked against NumPy; node 2's ranks
    only meet them after each cell."""
    mpiexec = Path(sys.executable).with_name("mpiexec")
    if not mpiexec.exists():
        pytest.skip("mpiexec (the mpich wheel) is not installed")
    rows_out = tmp_path / "rows.jsonl"
    worker = [sys.executable, "-m", "commd.bench.mpi_worker", "--ops", "allreduce,sendrecv", "--min-bytes", "1K",
              "--max-bytes", "4K", "--iters", "2", "--warmup", "0", "--group-nodes", "2,3", "--rows-out",
              str(rows_out)]
    argv = [str(mpiexec)]
    for node, n in (("n0", 1), ("n1", 1), ("n2", 2)):
        argv += [*([":"] if node != "n0" else []), "-n", str(n), "-env", "COMMD_NODE", node, *worker]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in rows_out.read_text().splitlines()]
    got = sorted((r["op"], r["bytes"], r["group"], r["world"], r["nodes"], r["group_nodes"], r["check"]) for r in rows)
    assert got == sorted((op, size, group, world, 2 if op == "sendrecv" or group != "world" else 3, count, "ok")
                         for op in ("allreduce", "sendrecv") for size in (1024, 4096)
                         for group, world, count in (("nodes 0-1", 2, 2), ("world", 4, 3)))


@pytest.mark.extended  # ~30 s on a loaded 2-core machine: 3 nodes' daemons and ranks
@pytest.mark.timeout(150)
def test_bench_worker_measures_subgroups_on_three_loopback_nodes_and_tunes_each_class(tmp_path: Path) -> None:
    """The worker on 3 nodes x 1 rank (loopback processes, as `commd launch --nnodes` runs them on one
    host) with --tune-out and no --group-nodes: the sweep's groups, the first 2 nodes and the whole job,
    through commd's lanes and Gloo directly, every result checked; the table has a cell per class."""
    from cluster import free_port

    from commd.runtime import new_secret
    from commd.scheduler.tuning import TuningTable

    port, secret = free_port(), new_secret()
    table_path, out = tmp_path / "table.json", tmp_path / "bench.json"
    procs = []
    for i in range(3):
        runtime = tmp_path / f"node{i}"
        runtime.mkdir()
        env = dict(os.environ, COMMD_RUNTIME_DIR=str(runtime), COMMD_NODE=f"n{i}", COMMD_SECRET=secret)
        env.pop("COMMD_JOB", None)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "commd", "launch", "--nnodes", "3", "--node-rank", str(i), "--master",
             f"127.0.0.1:{port}", "--nproc-per-node", "1", "-m", "commd.bench.worker", "--ops", "allreduce,sendrecv",
             "--min-bytes", "4K", "--max-bytes", "4K", "--iters", "2", "--warmup", "0", "--lanes", "all",
             "--compare", "gloo", "--tune-out", str(table_path), "--json", str(out)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(outputs)
    rows = json.loads(out.read_text())["rows"]
    got = {(r["group"], r["op"], r["path"]): (r["world"], r["nodes"], r["check"]) for r in rows}
    assert got == {(group, op, path): (world, 2 if op == "sendrecv" else nodes, "ok")
                   for group, world, nodes in (("nodes 0-1", 2, 2), ("world", 3, 3))
                   for op in ("allreduce", "sendrecv") for path in ("commd/gloo", "commd/tcp", "gloo")}
    assert "allreduce  (group nodes 0-1: 2 ranks on 2 nodes" in outputs[0]
    table = TuningTable.load(table_path)
    assert sorted({(e.kind, e.nodes) for e in table.entries}) == [("allreduce", "2"), ("allreduce", "3-4"),
                                                                 ("sendrecv", "2")]
