"""commd.ft.ShardedGuard: FSDP2 over a 2 x 2 (replicate, shard) mesh loses a rank and goes on.

Four ranks, two replicas of two shards, under `commd launch --max-restarts 1`; rank 3 SIGKILLs
itself at step 3.  Its replica's other rank leaves the job (ReplicaLostError), the other replica
goes on alone, and when the launcher has started ranks 2 and 3 again they come back as a replica,
receiving their shards and optimizer state from the running one.  Every rank's full parameters
must be equal, and equal to one process trained with that membership.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ft_launched import launch
from ft_workers import reference_with_members

WORLD, VICTIM, FAIL_STEP, STEPS = 4, 3, 3, 12


@pytest.mark.extended
@pytest.mark.timeout(300)
def test_a_replica_that_lost_a_rank_leaves_and_comes_back_whole(backend_env: Path, tmp_path: Path) -> None:
    stderr, names, results = launch("ft_hsdp_worker.py", WORLD, tmp_path, VICTIM, FAIL_STEP, STEPS)
    assert "ReplicaLostError: rank 2: its replica [2, 3] lost ranks [3], so it left the job" in stderr, stderr[-3000:]
    assert names == ["rank0.pt", "rank1.pt", "rank2.restart1.pt", "rank3.restart1.pt"], (names, stderr[-3000:])
    back_at = results[2]["first_step"]
    assert results[3]["first_step"] == back_at and FAIL_STEP < back_at < STEPS, (back_at, results[3]["first_step"])
    for rank, out in results.items():
        assert out["steps"] == STEPS and tuple(out["ranks"]) == tuple(range(WORLD)), (rank, out)
        (epoch, step, joined, members, _seconds, state_bytes), = out["joins"]
        assert (epoch, step, joined, members) == (2, back_at, (2, 3), tuple(range(WORLD))), (rank, out["joins"])
        assert state_bytes > 0, (rank, out["joins"])
    for rank in (0, 1):
        assert results[rank]["recoveries"] == [(FAIL_STEP, (2, 3), (0, 1))], results[rank]
    expected = reference_with_members(STEPS, {0: list(range(WORLD)), FAIL_STEP: [0, 1], back_at: list(range(WORLD))})
    for rank, out in results.items():
        for got, want in zip(out["params"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, r=rank: f"rank {r}: {m}")
        assert all(torch.equal(a, b) for a, b in zip(out["params"], results[0]["params"], strict=True)), rank
