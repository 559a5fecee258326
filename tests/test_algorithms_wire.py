"""Programs on the tcp lane, the daemon's catalogue of programs, and the release's program fields.

The lane tests run K real TcpLanes in threads on 127.0.0.1 with a stand-in program runner
(a whole-buffer exchange reduced in node order, checked against NumPy): they prove the
lane's part (DSL rank = the node's index in ``nodes``, the hash agreement, failures as
LaneErrors) whatever the interpreter does.  Catalogue tests use stand-in stages (reader,
checker, library) so that each refusal path is exercised on purpose.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import algorithm_workers as aw
import numpy as np
import pytest
import torch
from algorithm_programs import twoshot_allreduce
from cluster import Cluster
from helpers import msccl_files_dir

from commd.algorithms import catalog as cat
from commd.algorithms.errors import ProgramError
from commd.algorithms.ir import Algorithm
from commd.lanes.base import LaneError, Transport, memory_view, refuse_program
from commd.lanes.tcp import TcpLane
from commd.protocol import fabric as wire
from commd.protocol import schema as s

SECRET = "job-secret-for-tests"
JOIN_S = 30.0


# ---- helpers ----------------------------------------------------------------------------------


def run_nodes(fns: Sequence[Callable[[], Any]]) -> list[Any]:
    """``fns[i]`` in thread i; each entry is its return value or the exception it raised (bounded)."""
    results: list[Any] = [None] * len(fns)

    def work(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            results[i] = exc

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(fns))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + JOIN_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [i for i, thread in enumerate(threads) if thread.is_alive()]
    if stuck:
        pytest.fail(f"node thread(s) {stuck} still running after {JOIN_S} s")
    return results


@pytest.fixture
def lanes() -> Iterator[Callable[[int], list[TcpLane]]]:
    made: list[TcpLane] = []

    def make(k: int) -> list[TcpLane]:
        new = [TcpLane(i, k, SECRET, "127.0.0.1", chunk_bytes=4096) for i in range(k)]
        made.extend(new)
        endpoints = [lane.endpoint for lane in new]
        outcome = run_nodes([lambda lane=lane: lane.connect(endpoints, 10.0) for lane in new])
        assert outcome == [None] * k
        return new

    yield make
    for lane in made:
        lane.close()


def empty_algo(name: str, ngpus: int, coll: str = "allreduce") -> Algorithm:
    return Algorithm(name=name, coll=coll, ngpus=ngpus, nchunksperloop=ngpus, nchannels=1, inplace=True, ranks=())


def program(name: str, ngpus: int, digest: str) -> cat.Program:
    return cat.Program(name, empty_algo(name, ngpus), digest, cat.LIBRARY)


DIGEST_A = "a" * 64
DIGEST_B = "b" * 64


class ExchangeRunner:
    """Stand-in interpreter: every node sends its whole buffer to every other and reduces all of
    them in ``nodes`` order; records what the lane handed it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[int, ...], int, int]] = []

    def __call__(self, tp: Transport, prog: cat.Program, nodes: tuple[int, ...], me: int, arr: np.ndarray,
                 out: np.ndarray, op: str, deadline: float, plans: Any) -> None:
        assert op == "sum" and deadline > time.monotonic() and out is arr
        self.calls.append((prog.name, nodes, me, arr.size))
        parts = [arr.copy() if i == me else np.empty_like(arr) for i in range(len(nodes))]
        for i, node in enumerate(nodes):
            if i != me:
                tp.post_send(node, memoryview(parts[me]).cast("B"))
                tp.post_recv(node, memoryview(parts[i]).cast("B"))
        tp.wait()
        arr[:] = np.sum(parts, axis=0, dtype=arr.dtype)


# ---- the lane runs a program ------------------------------------------------------------------


def test_lane_runs_program_as_rank_of_its_index(lanes: Callable[[int], list[TcpLane]]) -> None:
    three = lanes(3)
    runners = [ExchangeRunner() for _ in three]
    for lane, runner in zip(three, runners, strict=True):
        lane.program_runner = runner
    nodes = (0, 2)  # node 2 is DSL rank 1
    rng = np.random.default_rng(1)
    inputs = {n: rng.integers(-1000, 1000, 1001).astype(np.int64) for n in nodes}
    bufs = {n: torch.from_numpy(inputs[n].copy()) for n in nodes}
    chosen = cat.Chosen("twoshot", DIGEST_A, program("twoshot", 2, DIGEST_A))
    out = run_nodes([lambda n=n: three[n].allreduce(nodes, bufs[n], "sum", 10.0, program=chosen) for n in nodes])
    assert out == [None, None]
    for n in nodes:
        np.testing.assert_array_equal(bufs[n].numpy(), inputs[0] + inputs[2])
    assert runners[0].calls == [("twoshot", nodes, 0, 1001)]
    assert runners[2].calls == [("twoshot", nodes, 1, 1001)]
    assert runners[1].calls == []


@pytest.mark.parametrize("theirs", ["other", "missing"])
def test_lane_refuses_on_every_node_when_a_copy_differs(lanes: Callable[[int], list[TcpLane]], theirs: str) -> None:
    two = lanes(2)
    runner = ExchangeRunner()
    for lane in two:
        lane.program_runner = runner
    nodes = (0, 1)
    good = cat.Chosen("mine", DIGEST_A, program("mine", 2, DIGEST_A))
    bad = (cat.Chosen("mine", DIGEST_A, program("mine", 2, DIGEST_B)) if theirs == "other"
           else cat.Chosen("mine", DIGEST_A, None, "unknown algorithm 'mine'"))
    bufs = [torch.ones(64, dtype=torch.float32) for _ in nodes]
    out = run_nodes([lambda: two[0].allreduce(nodes, bufs[0], "sum", 10.0, program=good),
                     lambda: two[1].allreduce(nodes, bufs[1], "sum", 10.0, program=bad)])
    for error in out:
        assert isinstance(error, LaneError) and error.code == "mismatch", error
        assert "'mine'" in str(error) and f"sha256 {DIGEST_A[:16]}" in str(error)
        assert (f"node 1 has sha256 {DIGEST_B[:16]}" if theirs == "other" else "node 1 has no such program") \
            in str(error)
    assert runner.calls == []  # not a step ran
    if theirs == "missing":
        assert "here: unknown algorithm 'mine'" in str(out[1])
    # the agreement exchange completed: the streams are in step and the lane goes on
    out = run_nodes([lambda i=i: two[i].allreduce(nodes, bufs[i], "sum", 10.0) for i in nodes])
    assert out == [None, None]
    assert bufs[0].tolist() == [2.0] * 64


def test_lane_checks_hashes_once_per_program_and_nodes(lanes: Callable[[int], list[TcpLane]]) -> None:
    """A second call sends no hashes: if it did, a runner that sends nothing would leave them
    unread, and the next native call would read a hash as data (a stream out of step)."""
    two = lanes(2)
    nodes = (0, 1)
    chosen = cat.Chosen("idle", DIGEST_A, program("idle", 2, DIGEST_A))
    calls: list[int] = []
    for lane in two:
        lane.program_runner = lambda tp, prog, nodes, me, arr, out, op, deadline, plans: calls.append(me)
    bufs = [torch.full((16,), float(i + 1)) for i in nodes]
    for _ in range(3):
        assert run_nodes([lambda i=i: two[i].allreduce(nodes, bufs[i], "sum", 10.0, program=chosen)
                          for i in nodes]) == [None, None]
    assert sorted(calls) == [0, 0, 0, 1, 1, 1]
    assert run_nodes([lambda i=i: two[i].allreduce(nodes, bufs[i], "sum", 10.0) for i in nodes]) == [None, None]
    assert bufs[1].tolist() == [3.0] * 16


def test_lane_runner_failure_is_a_lane_error_naming_the_call(lanes: Callable[[int], list[TcpLane]]) -> None:
    two = lanes(2)

    def broken(tp: Transport, prog: cat.Program, nodes: Any, me: int, arr: Any, out: Any, op: str,
               deadline: float, plans: Any) -> None:
        raise RuntimeError("plan cannot be built")

    for lane in two:
        lane.program_runner = broken
    chosen = cat.Chosen("bad", DIGEST_A, program("bad", 2, DIGEST_A))
    bufs = [torch.zeros(8) for _ in range(2)]
    out = run_nodes([lambda i=i: two[i].allreduce((0, 1), bufs[i], "sum", 5.0, program=chosen) for i in range(2)])
    for error in out:
        assert isinstance(error, LaneError)
        assert "algorithm 'bad'" in str(error) and "plan cannot be built" in str(error)


def test_lanes_without_programs_refuse_one() -> None:
    refuse_program("gloo", None)  # no program: nothing to refuse
    with pytest.raises(LaneError, match="lane 'gloo' cannot run algorithm 'twoshot'"):
        refuse_program("gloo", cat.Chosen("twoshot", DIGEST_A, None))


def test_memory_view_of_numpy_runner_buffers_is_shared() -> None:
    """The runner gets ``flat.numpy()``: writes must land in the lane's tensor (no copy)."""
    t = torch.zeros(4, dtype=torch.int32)
    arr = t.reshape(-1).numpy()
    arr[:] = 7
    assert t.tolist() == [7] * 4 and len(memory_view(t)) == 16


# ---- the catalogue ----------------------------------------------------------------------------


def fake_tools(library: dict[str, Callable[[int], Algorithm]] | None = None,
               refuse: dict[str, str] | None = None) -> cat.Tools:
    """Stand-in stages: a "file" is one line ``coll ngpus name``; the checker refuses the
    programs named in ``refuse`` (by algorithm name) with the given reason."""
    library = library if library is not None else {"twoshot": lambda n: empty_algo("twoshot", n)}
    refuse = refuse or {}

    def load(path: Path) -> Algorithm:
        fields = path.read_text().split()
        if len(fields) != 3:
            raise ProgramError("not a program", source=str(path))
        return empty_algo(fields[2], int(fields[1]), fields[0])

    def check(algo: Algorithm, post: Any, source: str) -> None:
        if algo.name in refuse:
            raise ProgramError(refuse[algo.name], source=source, rank=1, threadblock=0, step=2)

    def library_get(name: str, nranks: int) -> Algorithm:
        if name not in library:
            raise ValueError(f"no library program {name!r}")
        return library[name](nranks)

    return cat.Tools(dumps=lambda algo: f"{algo.coll}/{algo.ngpus}/{algo.name}", load=load, check=check,
                     postcondition=lambda algo, sidecar, source: sidecar, library_get=library_get,
                     library_names=lambda: sorted(library))


def test_catalog_library_programs_compiled_per_node_count_and_cached() -> None:
    built: list[int] = []

    def twoshot(n: int) -> Algorithm:
        built.append(n)
        return empty_algo("twoshot", n)

    catalog = cat.Catalog(tools=fake_tools({"twoshot": twoshot}))
    p3 = catalog.runnable("twoshot", "allreduce", 3, "float32", "sum")
    assert isinstance(p3, cat.Program) and p3.algo.ngpus == 3 and p3.source == cat.LIBRARY
    import hashlib
    assert p3.digest == hashlib.sha256(b"allreduce/3/twoshot").hexdigest()
    assert catalog.runnable("twoshot", "allreduce", 3, "int64", "max") is p3
    p2 = catalog.get("twoshot", 2)
    assert isinstance(p2, cat.Program) and p2.digest != p3.digest
    assert built == [3, 2]


def test_catalog_says_why_a_program_cannot_run() -> None:
    catalog = cat.Catalog(tools=fake_tools({"twoshot": lambda n: empty_algo("twoshot", n),
                                            "a2a": lambda n: empty_algo("a2a", n, "alltoall")}))
    assert catalog.runnable("nosuch", "allreduce", 2, "float32", "sum") == \
        "unknown algorithm 'nosuch' (known: a2a, twoshot)"
    assert "programs run allgather, allreduce, alltoall, alltonext only" in \
        catalog.runnable("twoshot", "broadcast", 2, "float32", None)
    assert catalog.runnable("a2a", "allreduce", 2, "float32", "sum") == \
        "algorithm 'a2a' is a alltoall program, not allreduce"
    assert "no bfloat16" in catalog.runnable("twoshot", "allreduce", 2, "bfloat16", "sum")


def test_catalog_library_program_the_checker_refuses_is_never_offered() -> None:
    catalog = cat.Catalog(tools=fake_tools(refuse={"twoshot": "rank 1 races on i[0]"}))
    reason = catalog.runnable("twoshot", "allreduce", 4, "float32", "sum")
    assert isinstance(reason, str) and "library program 'twoshot' for 4 nodes cannot be used" in reason
    assert "rank 1, threadblock 0, step 2: rank 1 races on i[0]" in reason


def test_catalog_user_files_checked_at_load(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "mine.xml").write_text("allreduce 3 mine")
    (tmp_path / "racy.xml").write_text("allreduce 3 racy")
    (tmp_path / "garbled.xml").write_text("<algo")
    (tmp_path / "twoshot.xml").write_text("allreduce 3 twoshot")
    (tmp_path / "fan.xml").write_text("custom 3 fan")  # custom without its sidecar
    (tmp_path / "notes.txt").write_text("not a program")
    with caplog.at_level("WARNING", logger="commd.algorithms"):
        catalog = cat.Catalog(tmp_path, tools=fake_tools(refuse={"racy": "two writes to o[1] unordered"}))
    assert sorted(catalog.files) == ["mine"]
    mine = catalog.runnable("mine", "allreduce", 3, "float32", "sum")
    assert isinstance(mine, cat.Program) and mine.source == str(tmp_path / "mine.xml")
    assert catalog.runnable("mine", "allreduce", 2, "float32", "sum") == \
        "algorithm 'mine' is written for 3 nodes, the op spans 2"
    refused = {r.name: r.reason for r in catalog.refused}
    assert sorted(refused) == ["fan", "garbled", "racy", "twoshot"]
    assert "rank 1, threadblock 0, step 2: two writes to o[1] unordered" in refused["racy"]
    assert "not a program" in refused["garbled"]
    assert "shadows the library's program 'twoshot'" in refused["twoshot"]
    assert "fan.xml.post.json" in refused["fan"]
    racy = catalog.runnable("racy", "allreduce", 3, "float32", "sum")
    assert isinstance(racy, str) and racy.startswith("algorithm 'racy' was refused at load:")
    assert all(str(tmp_path / f"{n}.xml") in caplog.text for n in refused)  # each refusal logged
    status = catalog.status()
    assert status["files"]["mine"]["sha256"] == mine.digest and len(status["refused"]) == 4


def test_catalog_custom_file_takes_its_sidecar(tmp_path: Path) -> None:
    (tmp_path / "fan.xml").write_text("custom 3 fan")
    (tmp_path / "fan.xml.post.json").write_text("{}")
    seen: list[Any] = []
    tools = fake_tools()
    tools = cat.Tools(tools.dumps, tools.load, lambda algo, post, source: seen.append(post), tools.postcondition,
                      tools.library_get, tools.library_names)
    catalog = cat.Catalog(tmp_path, tools=tools)
    assert sorted(catalog.files) == ["fan"] and seen == [tmp_path / "fan.xml.post.json"]


def test_algorithms_dir_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cat.ENV_DIR, raising=False)
    assert cat.resolve_dir(None, None) is None
    assert cat.resolve_dir(None, str(tmp_path)) == tmp_path
    other = tmp_path / "env"
    other.mkdir()
    monkeypatch.setenv(cat.ENV_DIR, str(other))
    assert cat.resolve_dir(None, str(tmp_path)) == other  # the environment beats the config
    assert cat.resolve_dir(str(tmp_path), None) == tmp_path  # the flag beats both
    with pytest.raises(ValueError, match="is not a directory"):
        cat.resolve_dir(str(tmp_path / "missing"), None)


def test_chosen_lookup_names_why_a_node_has_no_program() -> None:
    catalog = cat.Catalog(tools=fake_tools())
    found = cat.Chosen.lookup(catalog, "twoshot", DIGEST_A, 2)
    assert found.program is not None and found.local_digest == found.program.digest
    missing = cat.Chosen.lookup(catalog, "nosuch", DIGEST_A, 2)
    assert missing.program is None and missing.local_digest == "" and "unknown algorithm" in missing.missing
    assert "no algorithm catalogue" in cat.Chosen.lookup(None, "x", DIGEST_A, 2).missing


# ---- the release's program fields -------------------------------------------------------------


def test_go_carries_program_name_and_hash() -> None:
    go = wire.Go("g", 3, 7, "tcp", algo="twoshot", algo_hash=DIGEST_A)
    item = go.to_wire()
    assert item["a"] == "twoshot" and item["ah"] == DIGEST_A
    assert wire.Go.from_wire(item) == go
    plain = wire.Go("g", 3, 7, "tcp")
    assert "a" not in plain.to_wire() and wire.Go.from_wire(plain.to_wire()) == plain


@pytest.mark.parametrize(("fields", "complaint"), [
    ({"a": "twoshot"}, "'ah' (algorithm hash) must be given exactly when 'a'"),
    ({"ah": DIGEST_A}, "'ah' (algorithm hash) must be given exactly when 'a'"),
    ({"a": "twoshot", "ah": "A" * 64}, "64 lowercase hex digits"),
    ({"a": "twoshot", "ah": "ab"}, "64 lowercase hex digits"),
    ({"a": 5, "ah": DIGEST_A}, "'a' (algorithm) must be a string"),
    ({"a": "", "ah": DIGEST_A}, "'a' (algorithm) must be 1 to 200 characters"),
])
def test_go_refuses_bad_program_fields(fields: dict[str, Any], complaint: str) -> None:
    item = {"t": "go", "g": "g", "s": 1, "o": 1, "l": "tcp", **fields}
    with pytest.raises(wire.FabricMessageError, match=complaint.replace("(", r"\(").replace(")", r"\)")):
        wire.Go.from_wire(item)


# ---- the real interpreter on the lane ---------------------------------------------------------


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize(("dtype", "op"), [("int64", "sum"), ("float32", "max"), ("int32", "bxor")])
def test_lane_runs_a_checked_program_through_the_interpreter(lanes: Callable[[int], list[TcpLane]], k: int,
                                                            dtype: str, op: str) -> None:
    """A hand-made two-shot all-reduce (accepted by the checker) on K lanes equals NumPy, bit for
    bit on every node, on sizes that do and do not divide into K chunks (and fewer elements than chunks)."""
    from commd.algorithms import checker, mscclxml

    algo = twoshot_allreduce(k)
    checker.check(algo)
    prog = cat.Program("handmade", algo, cat.digest_of(algo, mscclxml.dumps), "test")
    chosen = cat.Chosen("handmade", prog.digest, prog)
    nodes = tuple(range(k))
    mine = lanes(k)
    reduce = {"sum": np.add, "max": np.maximum, "bxor": np.bitwise_xor}[op]
    for n in (1, k * 3, 1000 + 1, 70_001):
        rng = np.random.default_rng(n)
        inputs = [(rng.standard_normal(n) * 100).astype(dtype) for _ in nodes]
        want = functools.reduce(reduce, inputs)
        bufs = [torch.from_numpy(a.copy()) for a in inputs]
        out = run_nodes([lambda i=i, b=bufs[i]: mine[i].allreduce(nodes, b, op, 20.0, program=chosen) for i in nodes])
        assert out == [None] * k, out
        for buf in bufs:
            assert buf.numpy().tobytes() == want.tobytes(), (n, dtype, op)


def test_real_catalog_accepts_a_checked_file_and_refuses_the_bad_ones(tmp_path: Path) -> None:
    from commd.algorithms import mscclxml

    mscclxml.dump(twoshot_allreduce(3, "mine"), tmp_path / "mine.xml")
    files = msccl_files_dir()
    shared = files / "NEG_ns3_peer2peer_8r_labelled_allgather.xml" if files is not None else None
    if shared is not None and shared.exists():
        (tmp_path / "peer2peer.xml").write_text(shared.read_text())
    broken = twoshot_allreduce(2, "racy")  # rank 0's second reduction no longer waits for the first
    (tmp_path / "garbled.xml").write_text("<algo name='x'")
    mscclxml.dump(broken, tmp_path / "racy.xml")
    text = (tmp_path / "racy.xml").read_text().replace('type="rrc"', 'type="r"', 1)
    (tmp_path / "racy.xml").write_text(text)  # a plain receive: the program no longer reduces → wrong result
    catalog = cat.Catalog(tmp_path)
    assert sorted(catalog.files) == ["mine"]
    mine = catalog.runnable("mine", "allreduce", 3, "float32", "sum")
    assert isinstance(mine, cat.Program)
    assert mine.digest == cat.digest_of(mscclxml.load(tmp_path / "mine.xml"), mscclxml.dumps)
    refused = {r.name: r.reason for r in catalog.refused}
    assert {"racy", "garbled"} <= set(refused)
    assert str(tmp_path / "racy.xml") in refused["racy"] and "rank 0" in refused["racy"]
    if shared is not None and shared.exists():
        assert "peer2peer" in refused


def test_programs_travel_from_node0_and_each_is_checked_again_where_it_arrives(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """What node 0 sends with its config (``shared``) is what a member adopts: a program it lacks is
    added, an equal copy kept, a differing copy refused here with both hashes, and a malformed or unsound
    program from node 0 is refused by this node's own checker; past the size bound a program stays home."""
    from commd.algorithms import mscclxml

    home, away = tmp_path / "home", tmp_path / "away"
    home.mkdir()
    away.mkdir()
    for stem, algo in (("same", twoshot_allreduce(3, "same")), ("new", twoshot_allreduce(2, "new")),
                       ("split", twoshot_allreduce(3, "ours"))):
        mscclxml.dump(algo, home / f"{stem}.xml")
    mscclxml.dump(twoshot_allreduce(3, "same"), away / "same.xml")
    mscclxml.dump(twoshot_allreduce(3, "theirs"), away / "split.xml")
    node0, member = cat.Catalog(home), cat.Catalog(away)
    sent = node0.shared()
    assert sorted(sent) == ["new", "same", "split"] and all(e["post"] is None for e in sent.values())
    sent["racy"] = {"xml": racy(2), "post": None}  # node 0 never sends one, but a member checks anyway
    sent["odd"] = {"xml": 7, "post": None}
    member.adopt(sent)
    assert sorted(member.files) == ["new", "same"]
    assert member.files["new"].source == cat.FROM_NODE0
    assert member.files["new"].digest == node0.files["new"].digest
    assert member.files["same"].source == str(away / "same.xml")
    reasons = {r.name: r.reason for r in member.refused}
    assert sorted(reasons) == ["odd", "racy", "split"]
    ours, theirs = (cat.short(c.files["split"].digest) if "split" in c.files else None for c in (node0, member))
    assert theirs is None and ours is not None
    assert f"differs from node 0's (sha256 {ours})" in reasons["split"]
    assert "wrong result" in reasons["racy"] and "XML text" in reasons["odd"]
    assert "was refused at load" in str(member.get("split", 3))
    monkeypatch.setattr(cat, "MAX_SHARED_BYTES", len(sent["new"]["xml"]) + 1)
    assert sorted(node0.shared()) == ["new"]  # the others would pass the bound


# ---- fabrics on loopback: selection, release and run ------------------------------------------


class ProgramCluster(Cluster):
    """A loopback fabric whose node i reads its programs from ``dirs[i]`` (COMMD_ALGORITHMS_DIR)."""

    def __init__(self, root: Path, nnodes: int, dirs: list[Path], **kwargs: Any) -> None:
        super().__init__(root, nnodes, 1, **kwargs)
        self.dirs = dirs

    def _env(self, i: int) -> dict[str, str]:
        return dict(super()._env(i), COMMD_ALGORITHMS_DIR=str(self.dirs[i]))


@pytest.fixture
def fabric(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., ProgramCluster]]:
    made: list[ProgramCluster] = []

    def make(nnodes: int, dirs: list[Path], config: str = "") -> ProgramCluster:
        monkeypatch.delenv("COMMD_SECRET", raising=False)
        extra = []
        if config:
            (tmp_path / "commd.toml").write_text(config)
            extra = ["--config", str(tmp_path / "commd.toml")]
        c = ProgramCluster(tmp_path / f"fab{len(made)}", nnodes, dirs, extra=extra)
        made.append(c)
        return c.start()

    yield make
    for c in made:
        c.stop()
        print(c.logs())


def program_dir(root: Path, name: str, files: dict[str, Algorithm | str]) -> Path:
    from commd.algorithms import mscclxml

    d = root / name
    d.mkdir()
    for stem, content in files.items():
        if isinstance(content, str):
            (d / f"{stem}.xml").write_text(content)
        else:
            mscclxml.dump(content, d / f"{stem}.xml")
    return d


def racy(n: int) -> str:
    """The two-shot program with its first reduction made a plain receive (the checker refuses it)."""
    from commd.algorithms import mscclxml

    return mscclxml.dumps(twoshot_allreduce(n, "racy")).replace('type="rrc"', 'type="r"', 1)


@pytest.mark.extended  # several processes, ~10 s: make test-extended (CI runs it too)
def test_two_nodes_rule_picks_a_user_file_and_bad_hints_fail_every_rank(
        fabric: Callable[..., ProgramCluster], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A config rule picks the checked user file for all-reduces (NumPy-exact on even and uneven
    sizes, counted per algorithm in the status); a refused file is listed and never runs; hints
    naming an unknown or refused program fail every rank naming it.  User programs travel with node
    0's config: node 1 has no 'pairs' of its own and runs node 0's; its own 'split' differs from node
    0's, so node 1 refuses it (both hashes in its status) and an op naming it fails every rank naming
    the released hash; the fabric goes on (a plain all-reduce after each failure works)."""
    from commd.algorithms import mscclxml

    ours, theirs = twoshot_allreduce(2), twoshot_allreduce(2, "renamed")
    d0 = program_dir(tmp_path, "n0", {"pairs": twoshot_allreduce(2), "racy": racy(2), "split": ours})
    d1 = program_dir(tmp_path, "n1", {"racy": racy(2), "split": theirs})
    ours_hash, theirs_hash = (cat.digest_of(a, mscclxml.dumps)[:16] for a in (ours, theirs))
    c = fabric(2, [d0, d1], config='[[algorithms]]\nname = "pairs"\nkind = "allreduce"\nmin_bytes = 16\n')
    sizes = [3, 1000, 70_001]
    cases = [("float32", "sum"), ("int64", "max")]
    assert set(c.join(c.start_workers(aw.allreduces, [None], sizes, cases), timeout=120).values()) == {"ok"}
    results = c.join(c.start_workers(aw.failing_hints, ["nosuch", "racy", "split"]), timeout=120)
    for rank, (unknown, refused, differs) in results.items():
        assert "unknown algorithm 'nosuch'" in unknown and "pairs" in unknown, (rank, unknown)
        assert "algorithm 'racy' was refused at load" in refused and "wrong result" in refused, (rank, refused)
        assert "algorithm 'split' differs between nodes" in differs, (rank, differs)
        assert f"release names sha256 {ours_hash}" in differs and "node 1 has no such program" in differs
    for node in range(2):
        fab = c.status(node)["fabric"]
        # the rule's range: every op of at least 16 bytes (the last: failing_hints' plain all-reduces of
        # 6 float32), not the 12-byte one, which ran the lane's own algorithm; 'split' never ran
        assert fab["algorithm_ops"] == {
            "pairs": {"ops": 5 + 3, "bytes": 4 * (1000 + 70_001 + 3 * 6) + 8 * (3 + 1000 + 70_001)},
            "native": {"ops": 1, "bytes": 12}}, fab["algorithm_ops"]
        files, refused = fab["algorithms"]["files"], fab["algorithms"]["refused"]
        if node == 0:
            assert [r["name"] for r in refused] == ["racy"]
            assert sorted(files) == ["pairs", "split"]
        else:
            assert [r["name"] for r in refused] == ["racy", "split"]
            assert f"this node's copy (sha256 {theirs_hash}) differs from node 0's (sha256 {ours_hash})" \
                in refused[1]["reason"]
            assert sorted(files) == ["pairs"] and files["pairs"]["path"] == "node 0"
    # `commd algo list --job` asks node 1's daemon which programs its fabric can run, and why not
    from commd.cli.main import main

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COMMD_RUNTIME_DIR", str(c.runtime[1]))
        assert main(["algo", "list", "--job", c.job]) == 0
    said = capsys.readouterr().out
    assert f"on the fabric of job '{c.job}' (2 nodes" in said
    assert "  twoshot: can run (allreduce, checked for 2 nodes)" in said
    assert "pairs (allreduce, from node 0," in said and ": can run" in said
    assert "  split: refused: this node's copy" in said and "  racy: refused:" in said


@pytest.mark.extended
def test_three_nodes_hinted_programs_equal_numpy(fabric: Callable[..., ProgramCluster], tmp_path: Path) -> None:
    """Each all-reduce program by hint on 3 nodes (the library's, and a user file) equals NumPy on
    several sizes, uneven ones included; the library's all-to-all by hint moves every block right."""
    d = program_dir(tmp_path, "algos", {"mine3": twoshot_allreduce(3)})
    names = ["mine3"]
    from commd.algorithms import library

    names += [n for n in library.names() if library.get(n, 3).coll == "allreduce"]
    c = fabric(3, [d, d, d])
    cases = [("float32", "sum"), ("int64", "min")]
    blocks = [1, 3, 20_000]
    out = c.join(c.start_workers(aw.allreduces_and_alltoalls, names, [1, 5, 4096, 100_003], cases,
                                 ["alltoall", None], blocks), timeout=150)
    assert set(out.values()) == {"ok"}, out
    counts = c.status(0)["fabric"]["algorithm_ops"]
    assert all(counts[n]["ops"] == 8 for n in names), counts
    assert counts["alltoall"]["ops"] == len(blocks), counts


# ---- the coordinator's choice (pure logic) ----------------------------------------------------


class AnyLane:
    def can_run(self, primitive: str, dtype: str, reduce_op: str | None, nodes: tuple[int, ...]) -> None:
        return None


def report(seq: int, node: int, nbytes: int = 4096, algo: str = "", lane: str = "", data: bytes | None = None,
           cid: int | None = None, kind: str = "allreduce") -> wire.Ready:
    if cid is not None:
        return wire.Ready.from_wire({"t": "ready", "g": "g", "s": seq, "c": cid, **({"d": data} if data else {})})
    sig = {"lane": lane, "algo": algo, "dtype": "float32", "count": nbytes // 4, "reduce_op": "sum", "scale": 1.0}
    item = {"t": "ready", "g": "g", "s": seq, "k": kind, "sig": sig, "ranks": [0, 1], "pl": [0, 1], "n": [0, 1],
            "mine": [node], "nb": nbytes, "to": 30.0}
    if data is not None:
        item["d"] = data
    return wire.Ready.from_wire(item)


def release(coord: Any, seq: int, **kw: Any) -> dict[int, list[dict[str, Any]]]:
    from commd.scheduler.coordinator import Outbox

    out = Outbox()
    for node in (0, 1):
        coord.report(node, [report(seq, node, **kw)], out)
    return {node: [m.to_wire() for m in messages] for node, messages in out.messages.items()}


def coordinator(config_text: str = "") -> Any:
    import tomllib

    from commd.scheduler.config import parse_config
    from commd.scheduler.coordinator import Coordinator

    catalog = cat.Catalog(tools=fake_tools({"twoshot": lambda n: empty_algo("twoshot", n),
                                            "a2a": lambda n: empty_algo("a2a", n, "alltoall")}))
    config = parse_config(tomllib.loads(config_text))
    return Coordinator(2, config, {"tcp": AnyLane(), "gloo": AnyLane()}, catalog=catalog), catalog


def test_coordinator_releases_the_hinted_program_with_its_hash() -> None:
    coord, catalog = coordinator()
    twoshot = catalog.get("twoshot", 2)
    assert isinstance(twoshot, cat.Program)
    sent = release(coord, 0, algo="twoshot", nbytes=8, data=b"\0" * 8)  # tiny, with contributions
    for node in (0, 1):
        (go,) = sent[node]
        assert (go["l"], go["a"], go["ah"]) == ("tcp", "twoshot", twoshot.digest)
        assert "r" not in go  # the program runs it: not reduced by the coordinator
    cid = sent[0][0]["c"]
    cached = release(coord, 1, cid=cid)  # the fast path releases the same program
    assert [(m["a"], m["ah"]) for m in cached[0]] == [("twoshot", twoshot.digest)]
    plain = release(coord, 2)
    assert "a" not in plain[0][0]


def test_coordinator_fails_every_node_when_a_hint_cannot_be_honoured() -> None:
    coord, _ = coordinator()
    cases = [({"algo": "nosuch"}, "unknown algorithm 'nosuch' (known: a2a, twoshot)"),
             ({"algo": "a2a"}, "algorithm 'a2a' is a alltoall program, not allreduce"),
             ({"algo": "twoshot", "lane": "gloo"}, "the op's lane is 'gloo'")]
    for seq, (kw, reason) in enumerate(cases):
        sent = release(coord, seq, **kw)
        for node in (0, 1):
            (fail,) = sent[node]
            assert fail["t"] == "fail" and fail["code"] == s.E_PROTOCOL and reason in fail["m"], fail


def test_coordinator_rules_pick_a_program_by_size_and_skip_one_that_cannot_run(
        caplog: pytest.LogCaptureFixture) -> None:
    coord, catalog = coordinator('[[algorithms]]\nname = "a2a"\n'
                                 '[[algorithms]]\nname = "twoshot"\nkind = "allreduce"\nmin_bytes = 1024\n'
                                 'max_bytes = 65536\n')
    with caplog.at_level("WARNING", logger="commd.coordinator"):
        big = release(coord, 0, nbytes=4096)
    assert big[0][0]["a"] == "twoshot"
    assert "algorithm rule for 'a2a' skipped for allreduce of 4096 bytes on 2 nodes: algorithm 'a2a' is a " \
        "alltoall program" in caplog.text
    small, huge = release(coord, 1, nbytes=512), release(coord, 2, nbytes=1 << 20)
    assert "a" not in small[0][0] and "a" not in huge[0][0]  # outside the rule's range: the lane's own
    lane_hint = release(coord, 3, nbytes=4096, lane="gloo")  # rules choose programs for tcp ops only
    assert lane_hint[0][0]["l"] == "gloo" and "a" not in lane_hint[0][0]


def test_algorithm_rules_in_the_config_are_validated() -> None:
    import tomllib

    from commd.scheduler.config import config_from_wire, parse_config

    config = parse_config(tomllib.loads('[scheduler]\nalgorithms_dir = "/x"\n'
                                        '[[algorithms]]\nname = "twoshot"\nmin_group = 2\nmax_bytes = 100\n'))
    assert config.algorithms_dir == "/x" and config.algorithm_rules[0].matches("allreduce", 100, 2)
    assert not config.algorithm_rules[0].matches("allreduce", 101, 2)
    assert config_from_wire(config.to_wire()).algorithm_rules == config.algorithm_rules  # travels to members
    for text, complaint in (('[[algorithms]]\nkind = "allreduce"\n', "'name' must be an algorithm's name"),
                            ('[[algorithms]]\nname = "x"\nlane = "tcp"\n', "unknown key(s) ['lane']"),
                            ('[[algorithms]]\nname = "x"\nkind = "nope"\n', "'kind' 'nope' is not"),
                            ('[[algorithms]]\nname = "x"\nmin_bytes = 9\nmax_bytes = 1\n', "empty range"),
                            ('[scheduler]\nalgorithms_dir = 3\n', "algorithms_dir must be a path")):
        with pytest.raises(ValueError, match=re.escape(complaint)):
            parse_config(tomllib.loads(text))


def test_status_text_counts_ops_per_algorithm_and_lists_refused_programs() -> None:
    from commd.cli.status import format_status

    text = format_status({"fabric": {
        "node": 0, "nodes": [], "lanes": ["tcp"],
        "algorithm_ops": {"twoshot": {"ops": 12, "bytes": 4096}, "native": {"ops": 3, "bytes": 12}},
        "algorithms": {"directory": "/algos", "files": {"mine": {"sha256": DIGEST_A, "path": "/algos/mine.xml"}},
                       "refused": [{"name": "racy", "path": "/algos/racy.xml", "reason": "rank 0: wrong result"}]},
    }})
    assert "inter-node ops per algorithm ('native': the lane's own): native 3 (12 B), twoshot 12 (4.0 KiB)" in text
    assert f"programs from /algos: mine (sha256 {DIGEST_A[:16]})" in text
    assert "REFUSED program racy: rank 0: wrong result" in text


# ---- all-to-all programs ----------------------------------------------------------------------


@pytest.mark.parametrize("block", [1, 7, 40_000])
def test_lane_runs_the_library_alltoall_program(lanes: Callable[[int], list[TcpLane]], block: int) -> None:
    """Node i's block j lands in node j's output at block i (NumPy transposition of the blocks)."""
    catalog = cat.Catalog()
    prog = catalog.runnable("alltoall", "alltoall", 3, "uint8", None)
    assert isinstance(prog, cat.Program), prog
    chosen = cat.Chosen("alltoall", prog.digest, prog)
    three = lanes(3)
    nodes = (0, 1, 2)
    rng = np.random.default_rng(block)
    inputs = [rng.integers(0, 256, 3 * block, dtype=np.uint8) for _ in nodes]
    outs = [torch.zeros(3 * block, dtype=torch.uint8) for _ in nodes]
    sizes = [block] * 3
    got = run_nodes([lambda i=i: three[i].alltoallv(nodes, torch.from_numpy(inputs[i]), sizes, outs[i], sizes, 20.0,
                                                    program=chosen) for i in nodes])
    assert got == [None] * 3, got
    for j in nodes:
        want = np.concatenate([inputs[i][j * block:(j + 1) * block] for i in nodes])
        np.testing.assert_array_equal(outs[j].numpy(), want)


def test_lane_refuses_an_alltoall_program_with_unequal_blocks(lanes: Callable[[int], list[TcpLane]]) -> None:
    two = lanes(2)
    chosen = cat.Chosen("a2a", DIGEST_A, program("a2a", 2, DIGEST_A))
    with pytest.raises(LaneError, match=r"needs one block size to and from every node, got in_sizes \[1, 2\]"):
        two[0].alltoallv((0, 1), torch.zeros(3, dtype=torch.uint8), [1, 2], torch.zeros(3, dtype=torch.uint8),
                         [1, 2], 5.0, program=chosen)


def alltoall_report(seq: int, node: int, splits: list[list[int]], algo: str = "") -> wire.Ready:
    """A 2-node all-to-all of int32, one rank per node; ``splits[r]``: rank r's splits_in."""
    sig = {"lane": "", "algo": algo, "dtype": "int32"}
    item = {"t": "ready", "g": "g", "s": seq, "k": "alltoall", "sig": sig, "ranks": [0, 1], "pl": [0, 1],
            "n": [0, 1], "mine": [node], "nb": 4 * sum(splits[node]), "to": 30.0,
            "a2a": [[node, splits[node], [splits[0][node], splits[1][node]]]]}
    return wire.Ready.from_wire(item)


def test_coordinator_releases_alltoall_programs_only_for_equal_node_blocks() -> None:
    from commd.scheduler.coordinator import Outbox

    coord, catalog = coordinator()
    for seq, (splits, algo) in enumerate([([[3, 3], [3, 3]], "a2a"), ([[3, 3], [3, 4]], "a2a"),
                                          ([[3, 3], [3, 3]], "twoshot")]):
        out = Outbox()
        for node in (0, 1):
            coord.report(node, [alltoall_report(seq, node, splits, algo)], out)
        got = {node: [m.to_wire() for m in ms] for node, ms in out.messages.items()}
        for node in (0, 1):
            (msg,) = got[node]
            if seq == 0:
                a2a = catalog.get("a2a", 2)
                assert isinstance(a2a, cat.Program) and (msg["a"], msg["ah"]) == ("a2a", a2a.digest)
            elif seq == 1:
                assert msg["t"] == "fail" and "range from 12 to 16 bytes" in msg["m"], msg
            else:
                assert msg["t"] == "fail" and "'twoshot' is a allreduce program, not alltoall" in msg["m"], msg


def test_torch_group_options_carry_an_algorithm() -> None:
    from commd.torch_backend.process_group import Options

    assert Options(algo="twoshot").algo == "twoshot" and Options().algo is None
    assert Options(lane="tcp", algo="ring").lane == "tcp"
    for bad in ("", 3):
        with pytest.raises(ValueError, match="algo must be an algorithm's name"):
            Options(algo=bad)  # type: ignore[arg-type]


def test_a_file_named_native_is_refused(tmp_path: Path) -> None:
    """'native' names the lane's own algorithm in hints, rules, tables and counts: no file may take it."""
    from commd.algorithms import mscclxml

    mscclxml.dump(twoshot_allreduce(2, "x"), tmp_path / "native.xml")
    catalog = cat.Catalog(tmp_path)
    assert not catalog.files
    assert "names the lane's own algorithm" in catalog.refused[0].reason
