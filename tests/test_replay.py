"""`commd replay`: trace checks, the replay plan, the torch and MPI executors, the command end to end.

The replayed traces are written here with ``write_rank``: two ranks, an all-reduce, an uneven
all-to-all with different byte counts on the two ranks, an all-gather into one tensor, a broadcast
from rank 1, a non-blocking all-reduce waited later, an all-reduce on each rank's own one-rank
subgroup, barriers, and two all-reduces of the same size waited only at the next step boundary
(as DDP's buckets are).  Each executor checks every result against NumPy in its first pass; the
runs are subprocesses bounded by timeouts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from commd.bench.replay import parse_paths
from commd.bench.replay_worker import (
    Action,
    CheckError,
    Replayer,
    ReplayError,
    build_plan,
    expected,
    inputs_of,
)
from commd.cli.main import main as commd_main
from commd.protocol.param_trace import (
    CommEntry,
    TraceError,
    load_dir,
    match_collectives,
    ops_of,
    rank_path,
    write_rank,
)
from commd.sim.hosts import netns_unavailable

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2
#: The recorded gap before each call of the test trace, and each call's duration.
GAP_NS = 1_000_000
DURATION_NS = 50_000
#: Ops of the test trace per rank, and those a pass checks (barriers carry no data).
OPS = 11
CHECKED = 9


# ---- traces ------------------------------------------------------------------------------------
def job_trace(rank: int, gap_ns: int = GAP_NS) -> list[CommEntry]:
    """Rank ``rank``'s entries of the two-rank test job (steps 0, 1 and 2)."""
    world = (0, 1)
    out = [CommEntry("init", pg_id=0, global_ranks=world), CommEntry("init", pg_id=1, global_ranks=(0,)),
           CommEntry("init", pg_id=2, global_ranks=(1,))]
    clock = [0]

    def add(comms: str, step: int = 0, gap: int = gap_ns, **fields: Any) -> None:
        clock[0] += gap
        out.append(CommEntry(comms, start_ns=clock[0], duration_ns=DURATION_NS, step=step, **fields))
        clock[0] += DURATION_NS

    def op(comms: str, req: int, waited: bool = True, step: int = 0, **fields: Any) -> None:
        fields.setdefault("pg_id", 0)
        fields.setdefault("global_ranks", world)
        add(comms, req=req, step=step, **fields)
        if waited:
            add("wait", req=req, step=step, gap=1000)

    op("all_reduce", 0, in_msg_size=1000, out_msg_size=1000, dtype="float", reduce_op="sum")
    op("all_reduce", 1, waited=False, in_msg_size=6, out_msg_size=6, dtype="long", reduce_op="max")
    ins, outs = ((5, 15), (5, 10)) if rank == 0 else ((10, 7), (15, 7))  # 20 elements in on rank 0, 17 on rank 1
    op("all_to_allv", 2, in_msg_size=sum(ins), out_msg_size=sum(outs), dtype="float", in_split=ins, out_split=outs)
    add("wait", req=1)  # the max all-reduce, issued before the all-to-all
    op("all_gather_base", 3, in_msg_size=3, out_msg_size=6, dtype="double")
    op("broadcast", 4, in_msg_size=7, out_msg_size=7, dtype="float", root=1)
    op("all_reduce", 5, pg_id=1 + rank, global_ranks=(rank,), in_msg_size=5, out_msg_size=5, dtype="int",
       reduce_op="sum")
    op("barrier", 6)
    op("all_reduce", 7, waited=False, step=1, in_msg_size=50, out_msg_size=50, dtype="float", reduce_op="sum")
    op("all_reduce", 8, waited=False, step=1, in_msg_size=50, out_msg_size=50, dtype="float", reduce_op="sum")
    op("barrier", 9, step=2)
    add("broadcast", step=2, pg_id=0, global_ranks=world, in_msg_size=4, out_msg_size=4, dtype="int", root=0)
    return out


def write_job(directory: Path, gap_ns: int = GAP_NS) -> Path:
    for rank in range(WORLD):
        write_rank(rank_path(directory, rank), job_trace(rank, gap_ns))
    return directory


def write_raw(directory: Path, per_rank: dict[int, list[dict[str, Any]]]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for rank, entries in per_rank.items():
        (directory / f"rank{rank}.json").write_text(json.dumps(entries))
    return directory


def _ar(**fields: Any) -> dict[str, Any]:
    entry = {"comms": "all_reduce", "pg_id": 0, "global_ranks": [0, 1], "in_msg_size": 4, "out_msg_size": 4,
             "dtype": "float", "req": 0}
    entry.update(fields)
    return entry


# ---- (a) what a trace must be ------------------------------------------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize(("rank1", "words"), [
    ([_ar(), {"comms": "all_reduce_v2", "in_msg_size": 4}], ["rank1.json entry 1", "comms", "all_reduce_v2"]),
    ([_ar(comms="all_to_allv", in_split=[1, 2], out_split=[2, 2])],
     ["rank1.json entry 0", "in_split sums to 3", "in_msg_size is 4"]),
    ([_ar(comms="broadcast", root=5)], ["rank1.json entry 0", "root 5 is not in the group's global_ranks [0, 1]"]),
    ([_ar(), _ar(pg_id=0, global_ranks=[1])], ["rank 1 entry 1", "pg_id 0 has ranks [1] here, [0, 1] elsewhere"]),
    ([_ar(dtype="float16")], ["rank1.json entry 0", "dtype must be one of"]),
])
def test_a_bad_file_names_its_file_entry_and_field(tmp_path: Path, rank1: list[dict[str, Any]],
                                                   words: list[str]) -> None:
    directory = write_raw(tmp_path / "t", {0: [_ar()], 1: rank1})
    with pytest.raises(TraceError) as caught:
        load_dir(directory)
    for word in words:
        assert word in str(caught.value), str(caught.value)


@pytest.mark.timeout(30)
def test_a_missing_rank_file_is_named(tmp_path: Path) -> None:
    directory = write_raw(tmp_path / "t", {0: [_ar()], 2: [_ar()]})
    with pytest.raises(TraceError, match=r"no trace for rank\(s\) \[1\] \(have \[0, 2\]\)"):
        load_dir(directory)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("rank0", "rank1", "words"), [
    ([_ar()], [_ar(), _ar(req=1)], ["different numbers of collectives", "rank 0: 1", "rank 1: 2"]),
    ([_ar()], [_ar(dtype="double")], ["disagree on dtype", "rank 0 entry 0: 'float'", "rank 1 entry 0: 'double'"]),
    ([_ar(comms="all_to_allv", in_split=[2, 2], out_split=[2, 2])],
     [_ar(comms="all_to_allv", in_split=[2, 2], out_split=[1, 3])],
     ["rank 0 entry 0 sends 2 elements to rank 1 (in_split)", "expects 1 (out_split)"]),
    ([_ar()], [_ar(), {"comms": "wait", "req": 7}], ["rank 1 entry 1", "wait for req 7"]),
    ([_ar(comms="all_gather_base", out_msg_size=8)], [_ar(comms="all_gather_base", out_msg_size=6)],
     ["rank 1 entry 0", "needs out_msg_size = 2 x in_msg_size = 8, got 6"]),
    ([], [_ar(comms="send", src_rank=1, dst_rank=0)], ["rank 1 sends 1 messages to rank 0, which receives 0"]),
    ([_ar(step=3), _ar(req=1, step=3)], [_ar(step=3), _ar(req=1, step=2)],
     ["rank 1 entry 1: step goes back from 3 to 2"]),
])
def test_a_traces_that_cannot_replay_together_are_refused(tmp_path: Path, rank0: list[dict[str, Any]],
                                                          rank1: list[dict[str, Any]], words: list[str]) -> None:
    directory = write_raw(tmp_path / "t", {0: rank0, 1: rank1})
    with pytest.raises(TraceError) as caught:
        match_collectives(load_dir(directory))
    for word in words:
        assert word in str(caught.value), str(caught.value)


# ---- the plan and the check, without processes ----------------------------------------------------
@pytest.mark.timeout(30)
def test_plan_issues_waits_defers_and_reuses_buffers(tmp_path: Path) -> None:
    plan = build_plan(load_dir(write_job(tmp_path / "t")), 1)
    ops = [a for a in plan.actions if a.mode != "wait"]
    assert len(ops) == plan.ops == OPS
    by = {a.entry.req: a for a in ops if a.entry.req is not None}
    assert by[0].mode == by[2].mode == "async"  # issued, then waited at the next entry
    assert by[1].mode == "async"  # issued before the all-to-all, waited after it
    wait_1 = next(a for a in plan.actions if a.mode == "wait" and a.entry.req == 1)
    assert plan.actions[wait_1.target].entry.req == 1  # type: ignore[index]
    assert by[7].mode == by[8].mode == "deferred"  # no wait: until the step boundary
    assert ops[-1].mode == "blocking"  # no request id
    # the two deferred all-reduces of one shape are in flight together: two buffers; the first
    # 1000-element all-reduce's buffer is free again when the next float op of its size comes
    assert by[7].buffers["buf"] != by[8].buffers["buf"]
    assert sorted(plan.buffers).count(("float", 50)) == 2
    assert plan.groups == [(1, (0,)), (2, (1,))]  # the whole job's group is the default group
    assert plan.steps == [0, 1, 2]
    gaps = {s: sum(a.gap_s for a in plan.actions if a.entry.step == s) for s in plan.steps}
    for row in plan.recorded:  # gaps plus durations, durations
        n = sum(1 for a in plan.actions if a.entry.step == row["step"])
        assert row["comm_s"] == pytest.approx(n * DURATION_NS / 1e9)
        assert row["wall_s"] == pytest.approx(gaps[row["step"]] + n * DURATION_NS / 1e9)
    assert plan.actions[0].gap_s == 0 and plan.actions[1].gap_s == pytest.approx(1e-6)
    assert sum(a.check for a in plan.actions) == CHECKED


@pytest.mark.timeout(30)
def test_expected_all_to_allv_takes_each_peer_s_block() -> None:
    rank0 = CommEntry("all_to_allv", pg_id=0, global_ranks=(0, 1), in_msg_size=20, out_msg_size=15, dtype="float",
                      in_split=(5, 15), out_split=(5, 10))
    rank1 = CommEntry("all_to_allv", pg_id=0, global_ranks=(0, 1), in_msg_size=17, out_msg_size=22, dtype="float",
                      in_split=(10, 7), out_split=(15, 7))
    a = Action(index=0, entry=rank1, group=(None, (0, 1)), peers=(rank0, rank1))
    want = expected(a, 1, (0, 1), "float32", "sum")["out"]
    np.testing.assert_array_equal(want, np.concatenate([inputs_of(0, 5, 15, "float32"), inputs_of(1, 10, 7, "float32")]))


class OneRank:
    """A one-rank world in NumPy: every op leaves its result as the library would; ``corrupt``: the
    all-reduces deliver one wrong element."""

    notes: list[str] = []

    def __init__(self, buffers: list[tuple[str, int]], corrupt: bool = False) -> None:
        self.arrays = [np.zeros(n, dtype={"float": np.float32, "long": np.int64}[d]) for d, n in buffers]
        self.corrupt = corrupt
        self.calls = 0

    def storage(self, dtype: str) -> str:
        return {"float": "float32", "long": "int64"}[dtype]

    def reduce_name(self, op: str) -> str:
        return op

    def issue(self, position: int, action: Action, nonblocking: bool) -> Any:
        self.calls += 1
        b = action.buffers
        if action.entry.comms == "all_to_allv":
            self.arrays[b["out"]][...] = self.arrays[b["in"]]
        if action.entry.comms == "all_reduce" and self.corrupt:
            self.arrays[b["buf"]][3] += 1
        return position

    def wait(self, handle: Any) -> None:
        pass

    def fill(self, buffer: int, values: np.ndarray) -> None:
        self.arrays[buffer][...] = values

    def read(self, buffer: int) -> np.ndarray:
        return self.arrays[buffer].astype(np.float64 if self.arrays[buffer].dtype.kind == "f" else np.int64)

    def barrier(self) -> None:
        pass


@pytest.mark.timeout(30)
def test_the_first_pass_catches_a_wrong_result_and_later_passes_spin_the_gaps(tmp_path: Path) -> None:
    entries = [_ar(global_ranks=[0], req=None, startTime_ns=0, duration_ns=0),
               _ar(global_ranks=[0], comms="all_to_allv", in_msg_size=6, out_msg_size=6, in_split=[6],
                   out_split=[6], req=None, startTime_ns=20_000_000, duration_ns=0),
               _ar(global_ranks=[0], dtype="long", reduce_op="max", req=3, startTime_ns=40_000_000)]
    plan = build_plan(load_dir(write_raw(tmp_path / "t", {0: entries})), 0)
    good = OneRank(plan.buffers)
    replayer = Replayer(plan, good, compute=True)
    first = replayer.iteration(check=True)
    assert replayer.checked == 3 and good.calls == 3
    assert first["wall_s"] >= 0.040  # two recorded gaps of 20 ms, spun
    assert replayer.iteration(check=False)["wall_s"] >= 0.040
    assert Replayer(plan, OneRank(plan.buffers), compute=False).iteration(check=False)["wall_s"] < 0.040
    with pytest.raises(CheckError, match=r"wrong result on rank 0: all_reduce of trace entry 0 .*element 3"):
        Replayer(plan, OneRank(plan.buffers, corrupt=True), compute=False).iteration(check=True)


@pytest.mark.timeout(30)
def test_paths_words() -> None:
    assert [p.label for p in parse_paths("commd,all-lanes,gloo,commd-tcp")] == \
        ["commd", "commd-tcp", "commd-gloo", "commd-mpi", "gloo"]
    assert [(p.backend, p.lane) for p in parse_paths("commd-mpi,mpi")] == [("commd", "mpi"), ("mpi", None)]
    with pytest.raises(ReplayError, match="unknown path 'nccl'"):
        parse_paths("commd,nccl")


# ---- the command's refusals ------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("make", "args", "words"), [
    (None, ["--paths", "commd"], ["not a directory of per-rank traces"]),
    ("job", ["--nproc-per-node", "3"], ["has 2 ranks (rank0..rank1.json)", "--nproc-per-node 3 makes 3"]),
    ("job", ["--paths", "commd,nccl"], ["unknown path 'nccl'"]),
    ("bad", [], ["rank0.json entry 0", "comms must be one of"]),
    ("job", ["--iters", "0"], ["--iters 0"]),
])
def test_invalid_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               make: str | None, args: list[str], words: list[str]) -> None:
    directory = tmp_path / "trace"
    if make == "job":
        write_job(directory)
    elif make == "bad":
        write_raw(directory, {0: [{"comms": "allreduce"}], 1: [_ar()]})
    before = set(Path(os.environ.get("TMPDIR", "/tmp")).glob("commd-replay-*"))
    assert commd_main(["replay", str(directory), *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("commd replay: ")
    for word in words:
        assert word in err, err
    assert set(Path(os.environ.get("TMPDIR", "/tmp")).glob("commd-replay-*")) == before  # nothing started


# ---- (b) the torch executor, two ranks on this host ----------------------------------------------------
def run_ranks(argv: list[str], env: dict[str, str], timeout: float = 100.0) -> list[subprocess.CompletedProcess[str]]:
    """The replay worker on every rank (env:// as torchrun gives it); every process reaped."""
    procs = [subprocess.Popen([sys.executable, "-m", "commd.bench.replay_worker", *argv], cwd=ROOT, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(WORLD)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(WORLD)]
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return done


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["gloo", "commd"])
@pytest.mark.extended
def test_b_torch_executor_replays_and_checks_every_op(backend_env: Path, tmp_path: Path, backend: str) -> None:
    trace = write_job(tmp_path / "trace")
    iters = 3
    out = tmp_path / "out-{rank}.json"
    done = run_ranks(["--trace", str(trace), "--backend", backend, "--iters", str(iters), "--warmup", "1",
                      "--out", str(out)], dict(os.environ))
    for proc in done:
        assert proc.returncode == 0, proc.stderr
    plans = {r: build_plan(load_dir(trace), r) for r in range(WORLD)}
    for rank in range(WORLD):
        result = json.loads(Path(str(out).replace("{rank}", str(rank))).read_text())
        assert result["checked"] == CHECKED, result
        assert result["ops"] == OPS and result["steps"] == [0, 1, 2]
        assert len(result["iterations"]) == iters
        gaps = {s: sum(a.gap_s for a in plans[rank].actions if a.entry.step == s) for s in plans[rank].steps}
        for it in result["iterations"]:
            assert [s["step"] for s in it["steps"]] == [0, 1, 2]
            assert it["wall_s"] == pytest.approx(sum(s["wall_s"] for s in it["steps"]), rel=1e-3)
            for s in it["steps"]:
                assert s["wall_s"] >= gaps[s["step"]]  # the recorded compute was spun
                assert 0 < s["comm_s"] < s["wall_s"]
        assert result["recorded"] == plans[rank].recorded
    lanes = json.loads(Path(str(out).replace("{rank}", "0")).read_text()).get("lanes")
    if backend == "gloo":
        assert lanes is None
    else:  # node 0's daemon counted the timed passes' ops only ('ring': all-reduces without the daemon)
        assert {k: sum(v["ops"] for v in row.values()) for k, row in lanes.items()} == {
            "allreduce": 6 * iters, "alltoall": iters, "allgather": iters, "broadcast": 2 * iters,
            "barrier": 2 * iters}
        assert set(lanes["alltoall"]) == {"local"}


@pytest.mark.timeout(60)
def test_b_worker_refuses_a_trace_of_another_world(backend_env: Path, tmp_path: Path) -> None:
    trace = write_raw(tmp_path / "t", {0: [_ar(global_ranks=[0, 1, 2])], 1: [_ar(global_ranks=[0, 1, 2])],
                                       2: [_ar(global_ranks=[0, 1, 2])]})
    done = run_ranks(["--trace", str(trace), "--backend", "gloo", "--out", str(tmp_path / "o{rank}.json")],
                     dict(os.environ), timeout=30)
    assert [p.returncode for p in done] == [2, 2]
    assert "the trace in" in done[0].stderr and "has 3 ranks, but this job has 2" in done[0].stderr


# ---- (c) the command end to end ---------------------------------------------------------------------------
def _commd(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "commd", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


@pytest.mark.extended  # (make test runs the same command through docs/tuning.md's example)
@pytest.mark.timeout(180)
def test_c_replay_commd_gloo_mpi_side_by_side(runtime_dir: Path, tmp_path: Path) -> None:
    trace = write_job(tmp_path / "trace", gap_ns=100_000)
    out = tmp_path / "replay.json"
    proc = _commd(["replay", str(trace), "--paths", "commd,gloo,mpi", "--nproc-per-node", "2", "--iters", "3",
                   "--json", str(out)], timeout=170)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    doc = json.loads(out.read_text())
    assert doc["format"] == "commd-replay" and doc["trace"]["world"] == WORLD
    assert doc["layout"]["world"] == WORLD and doc["settings"]["iters"] == 3
    assert doc["recorded"]["steps"] == 3 and doc["recorded"]["step_ms"]["median"] > 0
    assert [p["path"] for p in doc["paths"]] == ["commd", "gloo", "mpi"]
    for row in doc["paths"]:
        assert row["status"] == "ok", row
        assert row["checked"] == WORLD * (CHECKED)
        assert row["samples"] == 3 * 3  # timed passes x steps
        assert row["step_ms"]["p95"] >= row["step_ms"]["median"] >= row["comm_ms"]["median"] > 0
        assert row["ratios"]["gloo"] == pytest.approx(doc["paths"][1]["step_ms"]["median"] / row["step_ms"]["median"])
        assert row["ratios"]["best_lane"] is None  # no single-lane path in this run
    assert doc["paths"][0]["lanes"]["alltoall"]["local"]["ops"] == 3  # node 0's daemon, the timed passes
    assert doc["load"]["cores"] == os.cpu_count()
    for word in ("recorded", "commd", "gloo", "mpi", "x gloo", "lanes each op kind took"):
        assert word in proc.stdout


# ---- (d) a recorded job replays as the same ops ------------------------------------------------------------
def _recording_rank(rank: int, directory: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), COMMD_RECORD=directory)
    import commd  # noqa: F401 - registers the backend

    dist.init_process_group("commd")
    sub = dist.new_group([0])
    dist.all_reduce(torch.ones(10))
    pending = dist.all_reduce(torch.full((6,), rank, dtype=torch.int64), op=dist.ReduceOp.MAX, async_op=True)
    rows_in, rows_out = ([1, 3], [1, 2]) if rank == 0 else ([2, 2], [3, 2])
    out = torch.empty(sum(rows_out), 5)
    dist.all_to_all_single(out, torch.arange(20, dtype=torch.float32).reshape(4, 5), rows_out, rows_in)
    pending.wait()
    dist.all_gather_into_tensor(torch.empty(6, dtype=torch.float64), torch.ones(3, dtype=torch.float64))
    dist.broadcast(torch.zeros(7), src=1)
    if rank == 0:
        dist.all_reduce(torch.ones(3), group=sub)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_d_a_recorded_job_replays_as_the_same_ops(backend_env: Path, tmp_path: Path) -> None:
    from test_torch_backend import spawn

    first, second = tmp_path / "dir1", tmp_path / "dir2"
    spawn(_recording_rank, (str(first),), nprocs=WORLD)
    recorded = load_dir(first)
    assert len(ops_of(recorded[0])) >= 7
    done = run_ranks(["--trace", str(first), "--backend", "commd", "--iters", "1", "--warmup", "0", "--compute",
                      "none", "--out", str(tmp_path / "o{rank}.json")],
                     {**os.environ, "COMMD_RECORD": str(second)})
    for proc in done:
        assert proc.returncode == 0, proc.stderr
    replayed = load_dir(second)
    for rank in range(WORLD):
        assert [e.shape_key() for e in ops_of(replayed[rank])] == [e.shape_key() for e in ops_of(recorded[rank])]


# ---- simulated hosts ---------------------------------------------------------------------------------------
@pytest.mark.extended
@pytest.mark.timeout(400)
def test_replay_on_two_simulated_hosts_pins_each_lane(runtime_dir: Path, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("simulated hosts need root (network namespaces)")
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    trace = write_job(tmp_path / "trace", gap_ns=100_000)
    out = tmp_path / "replay.json"
    proc = _commd(["replay", str(trace), "--hosts", "2", "--paths", "commd-tcp,commd-gloo,commd-mpi,mpi",
                   "--iters", "2", "--json", str(out)], timeout=390)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    doc = json.loads(out.read_text())
    assert doc["layout"] == {"hosts": 2, "nproc_per_node": 1, "world": 2, "rate": None, "delay_ms": None}
    rows = {r["path"]: r for r in doc["paths"]}
    for label, lane in (("commd-tcp", "tcp"), ("commd-gloo", "gloo")):
        assert rows[label]["status"] == "ok" and rows[label]["checked"] == WORLD * (CHECKED)
        used = {used_lane for row in rows[label]["lanes"].values() for used_lane in row}
        assert used - {"local"} == {lane}, rows[label]["lanes"]  # ("local": the one-rank subgroups)
        assert set(rows[label]["lanes"]["alltoall"]) == {lane} and rows[label]["lanes"]["alltoall"][lane]["ops"] == 2
    assert rows["commd-mpi"]["status"] == "skipped" and "no lane 'mpi'" in rows["commd-mpi"]["reason"]
    assert rows["mpi"]["status"] == "ok"
    assert doc["best_lane"] in ("commd-tcp", "commd-gloo")
