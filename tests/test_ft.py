"""commd.ft: a rank dies and the survivors go on training on a shrunk group, without a restart.

Four spawned ranks on one node train a small MLP under ``commd.ft.Guard``; rank 3 SIGKILLs
itself at step 3, before its forward or in the middle of its backward (one DDP bucket's
all-reduce already submitted, the next not).  The survivors' parameters must equal a
single-process model trained on the same batches: every rank's for the steps before the
redone one, the survivors' from it on.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from ft_workers import reference, run_bounded

pytestmark = pytest.mark.timeout(240)

WORLD = 4
VICTIM = 3
FAIL_STEP = 3
STEPS = 6
#: Bound on the ranks of one test; recovery itself takes well under a second.
RANKS_BOUND_S = 150.0


def _rank_main(rank: int, port: int, victims: dict[int, str], min_ranks: int, out_dir: str,
               recover_timeout: float, count_on: str | None = None) -> None:
    from ft_workers import guarded_training, sigkill_self

    def kill(step: int, at: str) -> None:
        if victims.get(rank) == at and step == FAIL_STEP:
            sigkill_self()

    try:
        out = guarded_training(rank, WORLD, f"tcp://127.0.0.1:{port}", STEPS, kill, min_ranks, recover_timeout,
                               count_on)
    except BaseException as exc:  # reported to the test, which judges it
        out = {"error": f"{type(exc).__name__}: {exc}"}
    torch.save(out, f"{out_dir}/rank{rank}.part")
    os.rename(f"{out_dir}/rank{rank}.part", f"{out_dir}/rank{rank}.pt")
    os._exit(0)  # without exit handlers: the failed group's client may not close cleanly


def _run(tmp_path: Path, victims: dict[int, str], min_ranks: int = 1,
         recover_timeout: float = 60.0, count_on: str | None = None) -> dict[int, dict[str, Any]]:
    """Start the ranks, wait (bounded) for all of them to exit, and read what the survivors wrote."""
    from cluster import free_port

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, victims, min_ranks, str(tmp_path),
                                                             recover_timeout, count_on)) for r in range(WORLD)]
    run_bounded(procs, RANKS_BOUND_S)
    assert all(procs[rank].exitcode == -signal.SIGKILL for rank in victims)
    results = {rank: torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)
               if (tmp_path / f"rank{rank}.pt").exists()}
    assert sorted(results) == [r for r in range(WORLD) if r not in victims], f"ranks that reported: {sorted(results)}"
    return results


@pytest.mark.parametrize("where", ["forward", pytest.param("backward", marks=pytest.mark.extended)])
def test_the_survivors_redo_the_step_and_train_as_one_process_would(backend_env, tmp_path: Path, where: str) -> None:
    results = _run(tmp_path, {VICTIM: where})
    survivors = [r for r in range(WORLD) if r != VICTIM]
    errors = [f"rank {rank}: {out['error']}" for rank, out in results.items() if "error" in out]
    if errors:
        pytest.fail("\n".join(errors), pytrace=False)
    for rank, out in results.items():
        assert len(out["recoveries"]) == 1, (rank, out["recoveries"])
        step, gone, kept, seconds = out["recoveries"][0]
        assert (step, list(gone), list(kept)) == (FAIL_STEP, [VICTIM], survivors), (rank, out["recoveries"])
        assert seconds < 10, (rank, seconds)
        # the rebuilt group waited a short attempt for its ranks, but its ops keep the job's timeout
        assert out["op_timeout"] == 60.0, (rank, out["op_timeout"])
    expected = reference(STEPS, WORLD, FAIL_STEP, survivors)
    for rank, out in results.items():
        for got, want in zip(out["params"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, r=rank: f"rank {r}: {m}")
    first = results[survivors[0]]["params"]
    for rank in survivors[1:]:  # the survivors hold the same bits
        assert all(torch.equal(a, b) for a, b in zip(first, results[rank]["params"], strict=True)), rank


@pytest.mark.extended
def test_the_users_collectives_in_the_step_go_on_on_guard_group(backend_env, tmp_path: Path) -> None:
    results = _run(tmp_path, {VICTIM: "forward"}, count_on="guard")
    for rank, out in results.items():
        assert "error" not in out, (rank, out)
        # the failed step's count is never seen: the step is redone on the survivors
        assert out["counts"] == [WORLD] * FAIL_STEP + [WORLD - 1] * (STEPS - FAIL_STEP), (rank, out["counts"])


def test_a_failure_inside_the_backward_leaves_the_old_ddp_out_of_the_redone_step(backend_env, tmp_path: Path) -> None:
    """A collective in a gradient hook fails mid-backward, after DDP marked the later layers ready.
    The redo's backward must not reach the old DDP's hooks (the test holds that DDP alive): they
    would raise "Expected to mark a variable ready only once"."""
    results = _run(tmp_path, {VICTIM: "forward"}, count_on="guard-in-backward")
    survivors = [r for r in range(WORLD) if r != VICTIM]
    expected = reference(STEPS, WORLD, FAIL_STEP, survivors)
    for rank, out in results.items():
        assert "error" not in out, (rank, out)
        assert out["counts"] == [WORLD] * FAIL_STEP + [WORLD - 1] * (STEPS - FAIL_STEP), (rank, out["counts"])
        for got, want in zip(out["params"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, r=rank: f"rank {r}: {m}")


@pytest.mark.extended
def test_a_collective_on_the_default_group_after_a_loss_fails_fast_saying_to_use_guard_group(
        backend_env, tmp_path: Path) -> None:
    """The guard rebuilds its own group only; the default group keeps the dead rank.  An op on it
    inside the step must not send the guard looking for a loss in its group until its timeout."""
    results = _run(tmp_path, {VICTIM: "forward"}, recover_timeout=60.0, count_on="world")
    for rank, out in results.items():
        error = out.get("error", "")
        assert error.startswith(f"UnrecoverableError: rank {rank}: an op failed for a dead rank (PeerDiedError: "), \
            (rank, out)
        assert f"every rank of the guard's group [0, 1, 2] is alive: the op ran on a group that still holds " \
               f"rank(s) [{VICTIM}], lost earlier" in error and "on guard.group" in error, (rank, error)


@pytest.mark.extended
def test_too_few_survivors_fail_every_survivor_loudly(backend_env, tmp_path: Path) -> None:
    results = _run(tmp_path, {VICTIM: "forward"}, min_ranks=WORLD)
    for rank, out in results.items():
        # (a survivor that gives up later may already count one that gave up and left before it)
        error = out.get("error", "")
        assert re.match(r"UnrecoverableError: [123] of 4 ranks survive \(ranks \[[0-2, ]+\]\); the guard needs at "
                        r"least 4", error), (rank, out)


@pytest.mark.extended
@pytest.mark.parametrize("victim", ["rank", "node"])
def test_across_nodes_the_survivors_go_on_without_a_dead_rank_or_node(cluster, victim: str) -> None:
    """2 simulated nodes x 2 ranks: rank 3 is SIGKILLed, or node 1's daemon with both its ranks; the
    survivors learn who is gone from their daemons (a dead node's ranks included) and go on."""
    import ft_workers as fw
    from cluster import free_port

    c = cluster(2, 2, peer_timeout=2.0, op_timeout=30.0)
    victims = [3] if victim == "rank" else [2, 3]
    workers = c.start_workers(fw.ft_on_nodes, free_port(), STEPS, FAIL_STEP, victims)
    for rank in victims:
        workers[1].wait_event(rank, "at fail step")
    if victim == "node":
        os.kill(c.daemon_pid(1), signal.SIGKILL)
    for rank in victims:
        os.kill(workers[1].procs[rank].pid, signal.SIGKILL)
    results = workers[0].join(timeout=120)
    if victim == "rank":
        results.update(workers[1].join(timeout=60, ranks=[2]))
    survivors = [r for r in range(4) if r not in victims]
    assert sorted(results) == survivors
    expected = reference(STEPS, 4, FAIL_STEP, survivors)
    for out in results.values():
        step, gone, kept, _seconds = out["recoveries"][0]
        assert (len(out["recoveries"]), step, list(gone), list(kept)) == (1, FAIL_STEP, victims, survivors), out
        for got, want in zip(out["params"], expected, strict=True):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)
    # node 0's daemon lists what it saw go, as commd status shows it (a dead node's ranks: through the
    # fabric's view of the nodes instead)
    from commd.cli.status import format_status

    status = c.status(0)
    gone = status["membership"]["gone_ranks"]  # the survivors' own departures follow the victims'
    for rank in victims:
        assert gone[str(rank)]["epoch"] <= len(victims), status["membership"]
        assert ("died" if victim == "rank" else "is gone with its node: node 1 (n1)") in gone[str(rank)]["why"], gone
    assert "ranks gone" in format_status(status), format_status(status)
    if victim == "node":
        assert [n["alive"] for n in status["fabric"]["nodes"]] == [True, False], status["fabric"]["nodes"]


@pytest.mark.extended  # two deaths in one step cost one attempt (4 s) more; make test-ft-random covers more
def test_a_second_death_during_recovery_ends_recovered_or_failed_on_every_survivor(backend_env,
                                                                                  tmp_path: Path) -> None:
    """Rank 3 dies before its forward and rank 2 in its backward of the same step, so the others may
    already be rebuilding without rank 3 alone.  Either the survivors converge on ranks 0 and 1 and
    train as one process would, or every survivor raises UnrecoverableError within the recovery
    timeout: never a mix, never a hang."""
    timeout = 20.0
    started = time.monotonic()
    results = _run(tmp_path, {3: "forward", 2: "backward"}, recover_timeout=timeout)
    assert time.monotonic() - started < 3 * timeout + 60, "the survivors took longer than their recovery bound"
    errors = {rank: out["error"] for rank, out in results.items() if "error" in out}
    if errors:
        assert sorted(errors) == [0, 1] and all(e.startswith("UnrecoverableError") for e in errors.values()), errors
        return
    for rank, out in results.items():
        steps = {step for step, _gone, _kept, _seconds in out["recoveries"]}
        gone = {r for _step, lost, _kept, _seconds in out["recoveries"] for r in lost}
        assert steps == {FAIL_STEP} and gone == {2, 3} and list(out["recoveries"][-1][2]) == [0, 1], (rank, out)
    expected = reference(STEPS, WORLD, FAIL_STEP, [0, 1])
    for out in results.values():
        for got, want in zip(out["params"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
