"""COMMD_RECORD: a job's ops on the commd backend, written as PARAM comms traces, checked op by op.

Two ranks issue known ops on a group of their own (blocking, non-blocking and waited later,
an uneven all-to-all with different byte counts on the two ranks, a subgroup) and train a
DDP model for a few steps on the default group; each rank's trace must list exactly the
ops it issued, with their sizes, splits, roots, groups and waits, and count the steps.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_torch_backend import spawn

from commd.protocol.param_trace import load_dir, ops_of

pytestmark = pytest.mark.timeout(180)

WORLD = 2
STEPS = 3


def _expected(rank: int) -> list[tuple]:
    """The ops the explicit part of ``_recording_rank`` issues on its own group, as (comms, in, out, dtype,
    in_split, out_split, root, reduce_op)."""
    rows_in = [1, 3] if rank == 0 else [2, 2]  # rank 0 sends 4 rows, rank 1 sends 4 rows of another split
    rows_out = [1, 2] if rank == 0 else [3, 2]
    width = 5
    return [
        ("all_reduce", 10, 10, "float", None, None, None, "sum"),
        ("all_reduce", 6, 6, "long", None, None, None, "max"),
        ("all_to_allv", 4 * width, 3 * width if rank == 0 else 5 * width, "float",
         tuple(r * width for r in rows_in), tuple(r * width for r in rows_out), None, None),
        ("all_gather_base", 3, 6, "double", None, None, None, None),
        ("broadcast", 7, 7, "float", None, None, 1, None),
        ("barrier", 0, 0, None, None, None, None, None),
    ]


def _recording_rank(rank: int, directory: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), COMMD_RECORD=directory)
    import commd  # noqa: F401 - registers the backend

    dist.init_process_group("commd")
    group = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(10), group=group)
    pending = dist.all_reduce(torch.full((6,), rank, dtype=torch.int64), op=dist.ReduceOp.MAX, group=group,
                              async_op=True)
    width = 5
    rows_in = [1, 3] if rank == 0 else [2, 2]
    rows_out = [1, 2] if rank == 0 else [3, 2]
    out = torch.empty(sum(rows_out), width)
    dist.all_to_all_single(out, torch.arange(4 * width, dtype=torch.float32).reshape(4, width), rows_out, rows_in,
                           group=group)
    pending.wait()
    gathered = torch.empty(6, dtype=torch.float64)
    dist.all_gather_into_tensor(gathered, torch.full((3,), float(rank), dtype=torch.float64), group=group)
    dist.broadcast(torch.zeros(7), src=1, group=group)
    dist.barrier(group=group)

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(STEPS):
        optimizer.zero_grad()
        model(torch.randn(2, 8)).sum().backward()
        optimizer.step()
    dist.destroy_process_group()


@pytest.mark.extended  # ~15 s; make test runs a recording through test_replay: make test-extended
def test_record_writes_each_rank_s_ops_as_a_param_trace(backend_env: Path, tmp_path: Path) -> None:
    directory = tmp_path / "trace"
    spawn(_recording_rank, (str(directory),), nprocs=WORLD)
    traces = load_dir(directory)  # (validates every entry and the group table)
    assert sorted(traces) == [0, 1]
    for rank, entries in traces.items():
        inits = {e.pg_id: e.global_ranks for e in entries if e.comms == "init"}
        ops = ops_of(entries)
        groups = {e.pg_id for e in ops}
        assert len(groups) == 2 and all(inits[pg] == (0, 1) for pg in groups), inits
        explicit_pg = ops[0].pg_id
        explicit = [e for e in ops if e.pg_id == explicit_pg]
        got = [(e.comms, e.in_msg_size, e.out_msg_size, e.dtype, e.in_split, e.out_split, e.root, e.reduce_op)
               for e in explicit]
        assert got == _expected(rank), f"rank {rank}"
        # every blocking op was waited at once; the MAX all-reduce only after the all-to-all
        waits = [e for e in entries if e.comms == "wait"]
        order = [e.req if e.comms == "wait" else ("op", e.req) for e in entries if e.comms != "init"]
        max_req = explicit[1].req
        assert order.index(max_req) > order.index(("op", explicit[2].req)), order[:12]
        for op in explicit:
            if op.comms != "all_reduce" or op.reduce_op != "max":
                assert order[order.index(("op", op.req)) + 1] == op.req, f"{op.comms} not waited at once"
        # DDP: its bucket all-reduces on the default group, one per step at least, in steps 0..STEPS-1
        ddp = [e for e in ops if e.pg_id != explicit_pg and e.comms == "all_reduce"]
        assert {e.step for e in ddp} == set(range(STEPS)), [e.step for e in ddp]
        assert all(e.in_msg_size == 8 * 4 + 4 for e in ddp), [e.in_msg_size for e in ddp]
        assert all(e.step == 0 for e in explicit)
        assert max(e.start_ns for e in entries if e.comms != "init") > 0 and waits


def _bad_directory_rank(rank: int, directory: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="1", LOCAL_RANK="0", COMMD_RECORD=directory)
    import commd  # noqa: F401
    from commd.runtime import ConfigError

    try:
        dist.init_process_group("commd")
    except ConfigError as exc:
        assert "COMMD_RECORD" in str(exc) and "cannot create" in str(exc), exc
        return
    raise AssertionError("a COMMD_RECORD that cannot be created was accepted")


def test_record_directory_that_cannot_be_made_fails_at_init_naming_it(backend_env: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    spawn(_bad_directory_rank, (str(blocker / "sub"),), nprocs=1)
