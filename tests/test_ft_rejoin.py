"""commd.ft: a lost rank started again by `commd launch --max-restarts` rejoins the running job.

Four ranks train under the guard; rank 1 SIGKILLs itself at step 3.  The survivors go on with
three ranks; the launcher starts rank 1 again, its guard asks to come back, and the survivors take
it in at the end of a step, sending it the model and optimizer state through the daemons.  Every
rank, the replacement too, must end with the same bits, equal to a single-process model trained
on the same batches with that membership: four ranks, then three, then four again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ft_launched import ROOT, SCRIPTS, launch
from ft_workers import reference_with_members

WORLD, VICTIM, FAIL_STEP, STEPS = 4, 1, 3, 14


@pytest.mark.extended  # (make test runs a rejoin too: the example of docs/fault-tolerance.md)
@pytest.mark.timeout(300)
def test_a_restarted_rank_rejoins_and_the_job_trains_as_one_process_would(backend_env: Path, tmp_path: Path) -> None:
    stderr, names, results = launch("ft_rejoin_worker.py", WORLD, tmp_path, VICTIM, FAIL_STEP, STEPS)
    assert f"rank {VICTIM} (pid " in stderr and "started it again (restart 1)" in stderr, stderr[-3000:]
    assert names == ["rank0.pt", "rank1.restart1.pt", "rank2.pt", "rank3.pt"], (names, stderr[-3000:])
    survivors = [r for r in range(WORLD) if r != VICTIM]
    back_at = results[VICTIM]["first_step"]
    assert FAIL_STEP < back_at < STEPS, back_at
    for rank, out in results.items():
        assert out["steps"] == STEPS and tuple(out["ranks"]) == tuple(range(WORLD)), (rank, out)
        (epoch, step, joined, members, seconds, state_bytes), = out["joins"]
        assert (epoch, step, joined, members) == (2, back_at, (VICTIM,), tuple(range(WORLD))), (rank, out["joins"])
        assert seconds < 60 and state_bytes > sum(p.numel() * 4 for p in out["params"]), (rank, out["joins"])
    for rank in survivors:
        assert results[rank]["recoveries"] == [(FAIL_STEP, (VICTIM,), tuple(survivors))], results[rank]
    assert results[VICTIM]["recoveries"] == []
    expected = reference_with_members(STEPS, {0: list(range(WORLD)), FAIL_STEP: survivors, back_at: list(range(WORLD))})
    for rank, out in results.items():
        for got, want in zip(out["params"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, r=rank: f"rank {r}: {m}")
        # every rank, the replacement too, holds the same bits
        assert all(torch.equal(a, b) for a, b in zip(out["params"], results[0]["params"], strict=True)), rank


@pytest.mark.extended
@pytest.mark.timeout(300)
def test_a_running_rank_that_diverged_is_found_at_the_admission_not_overwritten(backend_env: Path,
                                                                                  tmp_path: Path) -> None:
    """Rank 2 (running, not the state's source) changes a parameter after the recovery.  The
    replacement gets rank 0's state, and the check that follows compares every rank's own: every
    rank raises rather than train on (before, rank 2 took rank 0's state too, hiding the fault)."""
    proc = subprocess.run(
        [sys.executable, "-m", "commd", "launch", "--max-restarts", "1", "--nproc-per-node", str(WORLD),
         str(SCRIPTS / "ft_rejoin_worker.py"), str(tmp_path), str(VICTIM), str(FAIL_STEP), str(STEPS), "2"],
        cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True, timeout=240,
        check=False)
    assert proc.returncode != 0, proc.stderr[-4000:]
    assert not list(tmp_path.glob("*.pt")), "a rank finished its training"
    message = "hold different parameters or optimizer states after the membership changed"
    raised = {rank for rank in range(WORLD) if f"[rank{rank}]" in proc.stderr
              and any(message in line for line in proc.stderr.splitlines() if line.startswith(f"[rank{rank}]"))}
    assert raised == set(range(WORLD)), proc.stderr[-6000:]
