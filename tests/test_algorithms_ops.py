"""All-gathers by program, the AllToNext op, and the third-party MSCCL files as ops.

Lane tests run K real TcpLanes in threads on 127.0.0.1 with the real interpreter; fabric tests
run K daemons on loopback (or one per simulated host) with workers that compare every result
with NumPy (tests/ops_workers.py).  References are NumPy: a concatenation for all-gather, a
shift by one rank for AllToNext.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import ops_workers as ow
import pytest
import torch
from cluster import Cluster
from helpers import msccl_files_dir
from test_algorithms_wire import SECRET, run_nodes

from commd.algorithms import catalog as cat
from commd.algorithms import library, mscclxml
from commd.algorithms.dsl import AllGather, Buffer, MSCCLProgram, chunk, fully_connected
from commd.algorithms.ir import Algorithm
from commd.lanes.base import LaneError
from commd.lanes.tcp import TcpLane


def direct_allgather(n: int, k: int = 1, inplace: bool = False, name: str = "") -> Algorithm:
    """Every rank sends its k input chunks straight to every other rank (and copies its own)."""
    with MSCCLProgram(name or f"direct_allgather_{n}", fully_connected(n), AllGather(n, k, inplace), 1) as prog:
        for r in range(n):
            for j in range(n):
                if inplace and j == r:
                    continue  # its block already sits in its output
                chunk(r, Buffer.input, 0, k).copy(j, Buffer.output, r * k)
    return prog.compile()


def chosen_for(algo: Algorithm, name: str = "prog") -> cat.Chosen:
    from commd.algorithms import checker

    checker.check(algo)
    prog = cat.Program(name, algo, cat.digest_of(algo, mscclxml.dumps), "test")
    return cat.Chosen(name, prog.digest, prog)


@pytest.fixture
def lanes() -> Iterator[Callable[[int], list[TcpLane]]]:
    made: list[TcpLane] = []

    def make(k: int) -> list[TcpLane]:
        new = [TcpLane(i, k, SECRET, "127.0.0.1", chunk_bytes=4096) for i in range(k)]
        made.extend(new)
        endpoints = [lane.endpoint for lane in new]
        assert run_nodes([lambda lane=lane: lane.connect(endpoints, 10.0) for lane in new]) == [None] * k
        return new

    yield make
    for lane in made:
        lane.close()


# ---- the lane runs all-gather and AllToNext programs -------------------------------------------


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize(("chunks", "inplace"), [(1, False), (2, True)])
def test_lane_allgatherv_by_program_equals_numpy(lanes: Callable[[int], list[TcpLane]], k: int, chunks: int,
                                                 inplace: bool) -> None:
    """Node i's bytes land at block i of every node's output (NumPy's concatenation), for sizes
    that do and do not divide into the program's chunks, in- and out-of-place programs."""
    chosen = chosen_for(direct_allgather(k, chunks, inplace))
    mine = lanes(k)
    nodes = tuple(range(k))
    for size in (1, 3, 4096 + 5, 50_001):
        rng = np.random.default_rng(size)
        inputs = [rng.integers(0, 256, size, dtype=np.uint8) for _ in nodes]
        outs = [torch.full((k * size,), 7, dtype=torch.uint8) for _ in nodes]
        got = run_nodes([lambda i=i, a=inputs[i], o=outs[i], s=size: mine[i].allgatherv(
            nodes, torch.from_numpy(a), o, [s] * k, 20.0, program=chosen) for i in nodes])
        assert got == [None] * k, got
        for out in outs:
            np.testing.assert_array_equal(out.numpy(), np.concatenate(inputs))


def test_lane_refuses_an_allgather_program_with_unequal_sizes(lanes: Callable[[int], list[TcpLane]]) -> None:
    two = lanes(2)
    chosen = chosen_for(direct_allgather(2))
    with pytest.raises(LaneError, match=r"needs one size from every node, got sizes \[2, 3\]"):
        two[0].allgatherv((0, 1), torch.zeros(2, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8), [2, 3],
                          5.0, program=chosen)


@pytest.mark.parametrize("k", [2, 3])
def test_lane_alltonext_by_the_library_program(lanes: Callable[[int], list[TcpLane]], k: int) -> None:
    """Node i's bytes into node i + 1's output; node 0's output keeps its bytes."""
    found = cat.Catalog().runnable("alltonext", "alltonext", k, "uint8", None)
    assert isinstance(found, cat.Program) and found.alltonext, found
    chosen = cat.Chosen("alltonext", found.digest, found)
    mine = lanes(k)
    nodes = tuple(range(k))
    for size in (1, 7, 40_003):
        rng = np.random.default_rng(size)
        inputs = [rng.integers(0, 256, size, dtype=np.uint8) for _ in nodes]
        outs = [torch.full((size,), 9, dtype=torch.uint8) for _ in nodes]
        got = run_nodes([lambda i=i, a=inputs[i], o=outs[i]: mine[i].alltonext(
            nodes, torch.from_numpy(a), o, 20.0, program=chosen) for i in nodes])
        assert got == [None] * k, got
        np.testing.assert_array_equal(outs[0].numpy(), np.full(size, 9, np.uint8))
        for i in nodes[1:]:
            np.testing.assert_array_equal(outs[i].numpy(), inputs[i - 1])


def test_catalog_offers_only_alltonext_programs_for_alltonext(tmp_path: Path) -> None:
    """The library's AllToNext is one; an all-to-all is not; a custom file whose postcondition is
    AllToNext's is one, and one whose postcondition is another custom collective's is not."""
    catalog = cat.Catalog()
    assert "not custom" in str(catalog.runnable("alltoall", "alltonext", 3, "uint8", None))
    assert "not allgather" in str(catalog.runnable("alltonext", "allgather", 3, "uint8", None))
    algo = library.get("alltonext", 3)
    mscclxml.dump(algo, tmp_path / "shift.xml")
    import json

    (tmp_path / "shift.xml.post.json").write_text(json.dumps(dict(library.sidecar("alltonext", 3), file="shift.xml")))
    mscclxml.dump(algo, tmp_path / "partial.xml")  # same program, a postcondition that says less
    doc = library.sidecar("alltonext", 3)
    (tmp_path / "partial.xml.post.json").write_text(json.dumps(dict(doc, file="partial.xml",
                                                                    expect=doc["expect"][:1])))
    user = cat.Catalog(tmp_path)
    assert sorted(user.files) == ["partial", "shift"], user.refused
    shift = user.runnable("shift", "alltonext", 3, "uint8", None)
    assert isinstance(shift, cat.Program) and shift.alltonext
    assert "postcondition is not AllToNext's" in str(user.runnable("partial", "alltonext", 3, "uint8", None))


# ---- the coordinator's choice (pure logic) ----------------------------------------------------


def report(kind: str, seq: int, node: int, placement: list[int], algo: str, **sig: Any) -> Any:
    from commd.protocol import fabric as wire

    ranks = list(range(len(placement)))
    item = {"t": "ready", "g": "g", "s": seq, "k": kind, "sig": {"lane": "", "algo": algo, **sig},
            "ranks": ranks, "pl": placement, "n": sorted(set(placement)),
            "mine": [r for r in ranks if placement[r] == node], "nb": 64, "to": 30.0}
    return wire.Ready.from_wire(item)


def coordinate(kind: str, placement: list[int], algo: str, **sig: Any) -> dict[int, dict[str, Any]]:
    """One op reported by every node to a coordinator with the real catalogue: each node's message."""
    from commd.scheduler.config import SchedulerConfig
    from commd.scheduler.coordinator import Coordinator, Outbox

    nodes = sorted(set(placement))

    class AnyLane:
        def can_run(self, *args: Any) -> None:
            return None

    coord = Coordinator(len(nodes), SchedulerConfig(), {"tcp": AnyLane()}, catalog=cat.Catalog())
    out = Outbox()
    for node in nodes:
        coord.report(node, [report(kind, 0, node, placement, algo, **sig)], out)
    return {node: ms[0].to_wire() for node, ms in out.messages.items()}


def test_coordinator_releases_allgather_and_alltonext_programs_only_when_they_fit() -> None:
    ok = coordinate("allgather", [0, 0, 1, 1], "alltoall", dtype="int32", counts=[3, 3, 3, 3])
    assert all(m["t"] == "fail" and "is a alltoall program, not allgather" in m["m"] for m in ok.values()), ok
    uneven = coordinate("allgather", [0, 0, 1], "alltoall", dtype="int32", counts=[3, 3, 3])
    assert all("the nodes give [24, 12] bytes" in m["m"] for m in uneven.values()), uneven
    shift = coordinate("alltonext", [0, 0, 1, 1], "alltonext", dtype="int32", count=5)
    found = cat.Catalog().runnable("alltonext", "alltonext", 2, "uint8", None)
    assert isinstance(found, cat.Program)
    assert all((m["t"], m["a"], m["ah"]) == ("go", "alltonext", found.digest) for m in shift.values()), shift
    crossed = coordinate("alltonext", [0, 1, 0, 1], "alltonext", dtype="int32", count=5)
    assert all(m["t"] == "fail" and "contiguous range of group ranks" in m["m"] for m in crossed.values()), crossed
    native = coordinate("alltonext", [0, 1, 0, 1], "", dtype="int32", count=5)
    assert all(m["t"] == "go" and m.get("a") is None for m in native.values()), native


# ---- fabrics on loopback ----------------------------------------------------------------------


class OpsCluster(Cluster):
    """A loopback (or simulated-host) fabric whose nodes read their programs from ``algorithms``."""

    def __init__(self, root: Path, nnodes: int, nproc: int, algorithms: Path | None = None, **kwargs: Any) -> None:
        super().__init__(root, nnodes, nproc, **kwargs)
        self.algorithms = algorithms

    def _env(self, i: int) -> dict[str, str]:
        env = super()._env(i)
        if self.algorithms is not None:
            env["COMMD_ALGORITHMS_DIR"] = str(self.algorithms)
        return env


@pytest.fixture
def fabric(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., OpsCluster]]:
    made: list[OpsCluster] = []

    def make(nnodes: int, nproc: int, algorithms: Path | None = None, **kwargs: Any) -> OpsCluster:
        monkeypatch.delenv("COMMD_SECRET", raising=False)
        c = OpsCluster(tmp_path / f"fab{len(made)}", nnodes, nproc, algorithms, **kwargs)
        made.append(c)
        return c.start()

    yield make
    for c in made:
        c.stop()
        print(c.logs())


def algorithms_dir(root: Path, files: dict[str, Algorithm]) -> Path:
    d = root / "algorithms"
    d.mkdir(exist_ok=True)
    for stem, algo in files.items():
        mscclxml.dump(algo, d / f"{stem}.xml")
    return d


@pytest.mark.slow
@pytest.mark.parametrize("nnodes", [2, 3])
def test_allgather_by_hint_equals_numpy(fabric: Callable[..., OpsCluster], tmp_path: Path, nnodes: int) -> None:
    """A user all-gather program chosen by the op's hint equals NumPy's concatenation (1 rank per
    node, counts that do and do not divide into its chunks); the native all-gather too; an
    all-gather of unequal node blocks hinted with the program fails on every rank, saying why,
    and the fabric goes on."""
    d = algorithms_dir(tmp_path, {"ag": direct_allgather(nnodes, 2)})
    c = fabric(nnodes, 1, d)
    out = c.join(c.start_workers(ow.allgathers, ["ag", None], [1, 5, 30_001], ["int64", "float32"]), timeout=120)
    assert set(out.values()) == {"ok"}, out
    assert c.status(0)["fabric"]["algorithm_ops"]["ag"]["ops"] == 6
    counts = [2] + [3] * (nnodes - 1)
    messages = c.join(c.start_workers(ow.failing_allgather, "ag", counts), timeout=60)
    for rank, message in messages.items():
        assert "every node gives the same number of bytes" in message, (rank, message)


@pytest.mark.parametrize(("nnodes", "nproc"), [(1, 2), *(pytest.param(*shape, marks=pytest.mark.slow)
                                                        for shape in [(1, 3), (2, 1), (2, 2), (3, 1), (3, 2)])])
def test_alltonext_equals_a_numpy_shift(fabric: Callable[..., OpsCluster], nnodes: int, nproc: int) -> None:
    """Rank r's output is rank r - 1's input, rank 0's untouched, with the library program between
    nodes and without (native send/recv pairs), on even and uneven counts and several dtypes."""
    c = fabric(nnodes, nproc)
    algos = ["alltonext", None] if nnodes > 1 else [None]
    out = c.join(c.start_workers(ow.alltonexts, algos, [1, 7, 1000, 100_003], ["float32", "int64", "uint8"]),
                 timeout=150)
    assert set(out.values()) == {"ok"}, out
    if nnodes > 1:
        assert c.status(0)["fabric"]["algorithm_ops"]["alltonext"]["ops"] == 12


@pytest.mark.slow
@pytest.mark.parametrize(("nnodes", "nproc"), [(1, 3), (2, 2)])
def test_alltonext_count_mismatch_fails_every_rank(fabric: Callable[..., OpsCluster], nnodes: int,
                                                   nproc: int) -> None:
    """Ranks that disagree on the count (one node against the other, or within one node) all get a
    MismatchError naming the field; the next AllToNext works."""
    c = fabric(nnodes, nproc)
    counts = [4] * (nnodes * nproc - 1) + [5] if nnodes == 1 else [4] * nproc + [5] * nproc
    messages = c.join(c.start_workers(ow.alltonext_mismatch, counts), timeout=90)
    for rank, message in messages.items():
        assert message.startswith("MismatchError") and "'count' differs" in message, (rank, message)


@pytest.mark.slow
def test_alltonext_and_allgather_programs_from_torch(fabric: Callable[..., OpsCluster], tmp_path: Path) -> None:
    """``commd.alltonext`` with torch tensors on the default group and on a group whose Options name
    the library program; torch's all-gathers on that group run the all-gather program its
    Options name (2 nodes x 2 ranks)."""
    from cluster import free_port

    c = fabric(2, 2, algorithms_dir(tmp_path, {"ag": direct_allgather(2)}))
    out = c.join(c.start_workers(ow.torch_alltonext, free_port(), "alltonext", 1001, "ag"), timeout=120)
    assert set(out.values()) == {"ok"}, out
    counts = c.status(0)["fabric"]["algorithm_ops"]
    assert counts["alltonext"]["ops"] == 1 and counts["ag"]["ops"] == 2, counts


@pytest.mark.extended
def test_torch_broadcasts_of_a_group_with_a_codec_run_compressed(fabric: Callable[..., OpsCluster]) -> None:
    """``commd.Options(compression="bf16")``: the group's float32 broadcasts between nodes are coded
    (checked in the workers against torch's rounding, sync, async and future; int64 and the default
    group exact); the node counts them (2 nodes x 2 ranks)."""
    from cluster import free_port

    c = fabric(2, 2)
    out = c.join(c.start_workers(ow.torch_compressed_broadcast, free_port()), timeout=120)
    assert set(out.values()) == {"ok"}, out
    assert c.status(0)["fabric"]["compression"]["bf16"]["ops"] == 5  # 3 broadcasts, 1 all-gather, 1 all-reduce


def test_torch_compression_settings_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from commd.torch_backend.process_group import Options, compression_from_environment

    assert Options(compression="lossless").compression == "lossless" and Options().compression is None
    assert Options(compression="auto").compression == "auto" and Options(compression="none").compression == "none"
    with pytest.raises(ValueError, match="compression: unknown codec 'zip' .*bf16.*or 'auto'.*or 'none'"):
        Options(compression="zip")
    monkeypatch.setenv("COMMD_COMPRESSION", "bf16")
    assert compression_from_environment() == "bf16"
    monkeypatch.setenv("COMMD_COMPRESSION", "auto")
    assert compression_from_environment() == "auto"
    monkeypatch.setenv("COMMD_COMPRESSION", "gzip")
    with pytest.raises(ValueError, match="COMMD_COMPRESSION: unknown codec 'gzip'"):
        compression_from_environment()


def test_torch_options_take_an_algorithm_per_op() -> None:
    from commd.torch_backend.process_group import Options

    assert Options(algo="twoshot").algos == {"all_reduce": "twoshot"}
    both = Options(algo={"all_gather": "ag", "alltonext": "alltonext"})
    assert both.algo is None and both.algos["all_gather"] == "ag"
    with pytest.raises(ValueError, match="programs run the ops"):
        Options(algo={"broadcast": "x"})
    with pytest.raises(ValueError, match="algo must be an algorithm's name"):
        Options(algo={"all_gather": ""})


# ---- the third-party MSCCL files on simulated hosts -------------------------------------------




MSCCL_DIR = msccl_files_dir()
#: The op kinds that run a program of each collective (a custom program runs as an op only when
#: it is AllToNext: commd has no op whose ranks hold buffers of different shapes).
OP_FOR_COLL = {"allreduce": "allreduce", "allgather": "allgather", "alltoall": "alltoall"}


def small_accepted_files() -> dict[int, list[tuple[Path, str]]]:
    """Per rank count (at most 4): the files the checker accepts, with their collective."""
    from commd.algorithms import checker, postcondition
    from commd.algorithms.errors import ProgramError

    found: dict[int, list[tuple[Path, str]]] = {}
    for path in sorted(MSCCL_DIR.glob("*.xml")) if MSCCL_DIR else []:
        try:
            algo = mscclxml.load(path)
            if algo.ngpus > 4:
                continue
            checker.check(algo, postcondition.for_algorithm(algo, source=path), source=str(path))
        except ProgramError:
            continue
        found.setdefault(algo.ngpus, []).append((path, algo.coll))
    return found


@pytest.mark.slow
@pytest.mark.skipif(MSCCL_DIR is None, reason="the third-party MSCCL files (shared/msccl) are not here")
def test_msccl_files_run_on_one_rank_per_simulated_host(sim_hosts: Any, tmp_path: Path,
                                                        fabric: Callable[..., OpsCluster]) -> None:
    """Every accepted file of at most 4 ranks, from an algorithms_dir, run by hint as the op its
    collective names on a fabric of one rank per simulated host: NumPy-exact results, and each
    file counted as the algorithm of its ops.  (custom_3r_fanout is the one file left out: its
    ranks' buffers differ in shape — rank 0 has no output, ranks 1 and 2 no input — which no
    commd op describes.)"""
    files = small_accepted_files()
    assert files, f"no accepted file of at most 4 ranks in {MSCCL_DIR}"
    runnable = {n: [(p, c) for p, c in group if c in OP_FOR_COLL] for n, group in files.items()}
    left_out = sorted(p.name for group in files.values() for p, c in group if c not in OP_FOR_COLL)
    assert left_out == ["custom_3r_fanout.xml"], left_out
    sizes = [1, 5, 4099, 65_537]
    for nranks, group in sorted(runnable.items()):
        if not group:
            continue
        d = tmp_path / f"algorithms{nranks}"
        d.mkdir()
        for path, _ in group:
            (d / path.name).write_text(path.read_text())
        hosts = sim_hosts(nranks)
        c = fabric(nranks, 1, d, hosts=hosts)
        algos = c.status(0)["fabric"]["algorithms"]
        assert sorted(algos["files"]) == sorted(p.stem for p, _ in group) and not algos["refused"], algos
        plan = [(p.stem, OP_FOR_COLL[coll]) for p, coll in group]
        out = c.join(c.start_workers(ow.programs, plan, sizes), timeout=300)
        assert set(out.values()) == {"ok"}, out
        counts = c.status(0)["fabric"]["algorithm_ops"]
        for path, coll in group:
            want = len(sizes) * (3 if coll == "allreduce" else 2)
            assert counts[path.stem]["ops"] == want, (path.name, counts)


@pytest.mark.slow
def test_alltonext_on_a_group_whose_ranks_alternate_between_nodes(fabric: Callable[..., OpsCluster]) -> None:
    """Group ranks 0..3 on nodes 0, 1, 0, 1: every shift crosses nodes, in both directions; the
    native path is NumPy's shift; a program (node i to node i + 1) cannot express it and is
    refused on every rank with the reason."""
    c = fabric(2, 2)
    out = c.join(c.start_workers(ow.alltonext_crossed, [0, 2, 1, 3], 10_001), timeout=90)
    for rank, (result, message) in out.items():
        assert result == "ok", (rank, result)
        assert "contiguous range of group ranks" in message, (rank, message)


# ---- programs with coded transfers (a lossless codec on every send) ---------------------------------


@pytest.mark.parametrize("name", ["ring", "twoshot"])
@pytest.mark.parametrize("codec", ["lossless", "lossless-zstd"])
def test_an_allreduce_program_with_a_lossless_codec_gives_the_uncoded_programs_bits(
        lanes: Callable[[int], list[TcpLane]], name: str, codec: str) -> None:
    """Every transfer of the program travels coded (CodedTransport) and decodes to the bytes that were
    sent: the result is bit for bit the same program run uncoded, and the lane counts the coded bytes."""
    from commd.codecs import get

    k = 3
    chosen = chosen_for(library.get(name, k), name)
    mine = lanes(k)
    nodes = tuple(range(k))
    rng = np.random.default_rng(3)
    inputs = [(rng.standard_normal(40_003) * 0.02).astype(np.float32) for _ in nodes]
    plain = [torch.from_numpy(a.copy()) for a in inputs]
    coded = [torch.from_numpy(a.copy()) for a in inputs]
    assert run_nodes([lambda i=i: mine[i].allreduce(nodes, plain[i], "sum", 20.0, program=chosen)
                      for i in nodes]) == [None] * k
    assert run_nodes([lambda i=i: mine[i].allreduce(nodes, coded[i], "sum", 20.0, program=chosen, codec=get(codec))
                      for i in nodes]) == [None] * k
    for i in nodes:
        assert coded[i].numpy().tobytes() == plain[i].numpy().tobytes(), f"node {i}"
    np.testing.assert_allclose(plain[0].numpy(), sum(inputs), rtol=1e-5, atol=1e-6)
    status = mine[0].compression_status()[codec]
    assert status["ops"] >= 1 and 0 < status["wire_bytes"] < status["raw_bytes"]


def test_a_program_with_a_lossy_codec_is_refused_before_anything_moves(lanes: Callable[[int], list[TcpLane]]) -> None:
    from commd.codecs import get

    two = lanes(2)
    with pytest.raises(LaneError, match="lossless codecs only"):
        two[0].allreduce((0, 1), torch.zeros(1000), "sum", 5.0, program=chosen_for(library.get("ring", 2), "ring"),
                         codec=get("bf16"))


def test_an_allgather_program_with_a_lossless_codec_equals_numpy(lanes: Callable[[int], list[TcpLane]]) -> None:
    from commd.codecs import get

    k = 2
    chosen = chosen_for(direct_allgather(k, 2))
    mine = lanes(k)
    nodes = tuple(range(k))
    for size in (4, 4 * 5003):  # (the second: tiles that do not hold whole float32 elements travel as bytes)
        inputs = [(np.random.default_rng(size + i).standard_normal(size // 4) * 0.02).astype(np.float32)
                  for i in nodes]
        outs = [torch.zeros(k * size, dtype=torch.uint8) for _ in nodes]
        got = run_nodes([lambda i=i, s=size, a=inputs[i], o=outs[i]: mine[i].allgatherv(
            nodes, torch.from_numpy(a.view(np.uint8)), o, [s] * k, 20.0, program=chosen,
            codec=get("lossless"), dtype="float32") for i in nodes])
        assert got == [None] * k, got
        for out in outs:
            np.testing.assert_array_equal(out.numpy(), np.concatenate(inputs).view(np.uint8))
