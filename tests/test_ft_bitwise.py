"""commd.ft's bitwise criterion: 50 steps after a recovery, the survivors' parameters are bit for bit
those of a fault-free job started from the same state, with the same membership and data.

Four spawned ranks on one node train a tiny MLP under ``commd.ft.Guard`` (CPU lanes); rank 3
SIGKILLs itself before its forward of step 3.  The survivors keep their model and optimizer state
as it is at the start of the redone step (after the recovery, before its forward) and their
parameters after 50 completed steps from there.  A fresh 3-rank job (plain DDP, no fault, its
ranks 0-2 reading the batches of survivors 0-2) loads that state and runs the same 50 steps:
every parameter must be ``torch.equal`` to the survivors'.

Two cases: the tiny model's two DDP buckets both go through the group's exchange ring (shared
memory, reduced by every rank in group-rank order); with 65536 inputs the first layer's 4 MiB
bucket is past the ring's largest op and goes through the daemon's local lane.  The survivors'
group (global ranks 0-2 of 4) and the fresh job's world (ranks 0-2 of 3) reduce in the same
order on both paths, hence the same bits.  (Gloo's reduction order differs: a fresh job on Gloo
misses by a few ulps, 1e-8, in most elements.)
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from ft_workers import run_bounded

pytestmark = [pytest.mark.extended, pytest.mark.timeout(300)]

WORLD = 4
VICTIM = 3
FAIL_STEP = 3
AFTER = 50  # completed steps after the recovery (the redone step included)
STEPS = FAIL_STEP + AFTER
SURVIVORS = [r for r in range(WORLD) if r != VICTIM]
#: Bound on the ranks of one job (53 steps of a tiny model and one recovery: seconds).
RANKS_BOUND_S = 120.0


def _rank_main(rank: int, out_dir: str, target: Callable[..., dict[str, Any]], args: tuple[Any, ...]) -> None:
    try:
        out = target(rank, *args)
    except BaseException as exc:  # reported to the test, which judges it
        out = {"error": f"{type(exc).__name__}: {exc}"}
    torch.save(out, f"{out_dir}/rank{rank}.part")
    os.rename(f"{out_dir}/rank{rank}.part", f"{out_dir}/rank{rank}.pt")
    os._exit(0)  # without exit handlers: a failed group's client may not close cleanly


def _spawn(out_dir: Path, world: int, target: Callable[..., dict[str, Any]],
           args: Callable[[int], tuple[Any, ...]]) -> tuple[dict[int, dict[str, Any]], list[int | None]]:
    """``target(rank, *args(rank))`` on ``world`` spawned ranks; bounded wait; what each wrote, and the exit codes."""
    out_dir.mkdir()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, str(out_dir), target, args(r))) for r in range(world)]
    run_bounded(procs, RANKS_BOUND_S)
    results = {rank: torch.load(out_dir / f"rank{rank}.pt") for rank in range(world)
               if (out_dir / f"rank{rank}.pt").exists()}
    errors = [f"rank {rank}: {out['error']}" for rank, out in results.items() if "error" in out]
    if errors:
        pytest.fail("\n".join(errors), pytrace=False)
    return results, [proc.exitcode for proc in procs]


@pytest.mark.parametrize("inputs", [32, 65536], ids=["ring", "ring-and-daemon"])
def test_fifty_steps_after_a_recovery_equal_a_fault_free_job_from_the_same_state_bitwise(
        backend_env, tmp_path: Path, inputs: int) -> None:
    import ft_workers as fw
    from cluster import free_port

    port = free_port()
    faulted, codes = _spawn(tmp_path / "faulted", WORLD, fw.guarded_with_snapshot,
                            lambda r: (WORLD, f"tcp://127.0.0.1:{port}", STEPS, FAIL_STEP, VICTIM, inputs))
    assert codes[VICTIM] == -signal.SIGKILL and sorted(faulted) == SURVIVORS, (codes, sorted(faulted))
    for rank, out in faulted.items():
        assert len(out["recoveries"]) == 1, (rank, out["recoveries"])
        step, gone, kept, _seconds = out["recoveries"][0]
        assert (step, list(gone), list(kept)) == (FAIL_STEP, [VICTIM], SURVIVORS), (rank, out["recoveries"])
        assert out["snapshot"]["step"] == FAIL_STEP, (rank, out["snapshot"]["step"])
        assert out["buckets"] == 2, (rank, out["buckets"])  # two all-reduces per step, not one
    # the survivors agree among themselves, at the recovery and 50 steps later
    first = faulted[SURVIVORS[0]]
    for rank in SURVIVORS[1:]:
        for name, value in first["snapshot"]["model"].items():
            assert torch.equal(value, faulted[rank]["snapshot"]["model"][name]), (rank, name)
        for key, state in first["snapshot"]["optimizer"]["state"].items():
            buf = faulted[rank]["snapshot"]["optimizer"]["state"][key]["momentum_buffer"]
            assert torch.equal(state["momentum_buffer"], buf), (rank, key)
        for i, (a, b) in enumerate(zip(first["params"], faulted[rank]["params"], strict=True)):
            assert torch.equal(a, b), f"survivors 0 and {rank} differ in parameter {i}"

    # a fault-free 3-rank job from each survivor's state, its ranks reading the survivors' batches
    port = free_port()
    replay, _codes = _spawn(tmp_path / "replay", len(SURVIVORS), fw.plain_ddp_from,
                            lambda r: (len(SURVIVORS), f"tcp://127.0.0.1:{port}", faulted[SURVIVORS[r]]["snapshot"],
                                       STEPS, SURVIVORS[r], inputs))
    assert sorted(replay) == list(range(len(SURVIVORS)))
    print(f"faulted job's ops: {faulted[SURVIVORS[0]]['paths']}\nfresh job's ops: {replay[0]['paths']}")
    for out in (faulted[SURVIVORS[0]], replay[0]):  # the all-reduces took the paths this case is for
        assert max(out["paths"]["ring_allreduces"].values()) >= AFTER - 1, out["paths"]
        assert ("allreduce" in out["paths"]["ops_by_lane"]) == (inputs > 32), out["paths"]
    problems = []
    for r, survivor in enumerate(SURVIVORS):
        assert replay[r]["buckets"] == 2, (r, replay[r]["buckets"])
        for i, (got, want) in enumerate(zip(replay[r]["params"], faulted[survivor]["params"], strict=True)):
            if not torch.equal(got, want):
                diff = (got - want).abs()
                problems.append(f"fresh rank {r} vs survivor {survivor}, parameter {i}: {int((diff > 0).sum())} of "
                                f"{diff.numel()} elements differ, max |diff| {float(diff.max()):.3g}")
    assert not problems, "\n".join(problems)
